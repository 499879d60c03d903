"""cgroup v2 has no devices controller: a BPF_PROG_TYPE_CGROUP_DEVICE program, built here as
bytes from the deny rules, is loaded and attached (BPF_F_ALLOW_MULTI) with the bpf(2) system
call through ctypes (isolator.py decides where)."""

from __future__ import annotations

import ctypes
import os
import platform
import struct
from pathlib import Path
from typing import Sequence

from .rules import DenyRange, IsolationError


# struct bpf_insn {u8 code; u8 dst_reg:4, src_reg:4; s16 off; s32 imm}, little-endian. Only these
# opcodes are emitted (the test's interpreter knows exactly these):
LDX_MEM_W = 0x61  # BPF_LDX | BPF_MEM | BPF_W:   dst = *(u32 *)(src + off)
ALU32_AND_K = 0x54  # BPF_ALU | BPF_AND | BPF_K: dst = (u32)dst & imm
JMP_JNE_K = 0x55  # BPF_JMP | BPF_JNE | BPF_K:   if dst != imm goto pc + 1 + off
JMP_JEQ_K = 0x15  # BPF_JMP | BPF_JEQ | BPF_K
JMP_JGT_K = 0x25  # BPF_JMP | BPF_JGT | BPF_K (unsigned)
JMP_JLT_K = 0xA5  # BPF_JMP | BPF_JLT | BPF_K (unsigned; Linux 4.14+)
ALU64_MOV_K = 0xB7  # BPF_ALU64 | BPF_MOV | BPF_K: dst = imm
JMP_EXIT = 0x95  # BPF_JMP | BPF_EXIT: return r0
# struct bpf_cgroup_dev_ctx {u32 access_type (type low 16 bits, access high 16); u32 major; u32 minor}
BPF_DEVCG_DEV_CHAR = 2


def insn(code: int, dst: int = 0, src: int = 0, off: int = 0, imm: int = 0) -> bytes:
    return struct.pack("<BBhi", code, (src << 4) | dst, off, imm)


def device_program(rules: Sequence[DenyRange]) -> bytes:
    """The eBPF program: 0 (deny) for a character device a rule denies, 1 (allow) otherwise.

        r2 = ctx->access_type & 0xffff; r4 = ctx->major; r5 = ctx->minor
        if r2 != CHAR goto allow
        for each rule: if r4 != major || r5 < first || r5 > last goto next
                       if r5 == kept minor goto allow   (for each kept minor)
                       return 0
        next: ...
        allow: return 1
    """
    # Items are instructions or ("jump", code, dst, imm, label); labels are resolved at the end.
    body: list = [insn(LDX_MEM_W, 2, 1, 0), insn(ALU32_AND_K, 2, imm=0xFFFF),
                  insn(LDX_MEM_W, 4, 1, 4), insn(LDX_MEM_W, 5, 1, 8),
                  ("jump", JMP_JNE_K, 2, BPF_DEVCG_DEV_CHAR, "allow")]
    labels: dict[str, int] = {}
    for number, rule in enumerate(rules):
        following = f"rule{number + 1}"
        body += [("jump", JMP_JNE_K, 4, rule.major, following), ("jump", JMP_JLT_K, 5, rule.first, following),
                 ("jump", JMP_JGT_K, 5, rule.last, following)]
        body += [("jump", JMP_JEQ_K, 5, minor, "allow") for minor in rule.allowed]
        body += [insn(ALU64_MOV_K, 0, imm=0), insn(JMP_EXIT)]
        labels[following] = len(body)
    labels["allow"] = len(body)
    body += [insn(ALU64_MOV_K, 0, imm=1), insn(JMP_EXIT)]
    out = []
    for pc, item in enumerate(body):
        if isinstance(item, tuple):
            _, code, dst, imm, label = item
            item = insn(code, dst, off=labels[label] - pc - 1, imm=imm)
        out.append(item)
    return b"".join(out)


# The bpf(2) system call, through ctypes (no compiled helper): numbers from <linux/bpf.h>.
BPF_PROG_LOAD = 5
BPF_PROG_ATTACH = 8
BPF_PROG_TYPE_CGROUP_DEVICE = 15
BPF_CGROUP_DEVICE = 6
BPF_F_ALLOW_MULTI = 2
SYS_BPF = {"x86_64": 321, "aarch64": 280, "ppc64le": 361, "riscv64": 280, "s390x": 351}


def prog_load_attr(insns_address: int, insn_count: int, license_address: int, name: bytes = b"mapa_gpus") -> bytes:
    """union bpf_attr for BPF_PROG_LOAD: prog_type, insn_cnt, insns, license, log_level, log_size,
    log_buf, kern_version, prog_flags, prog_name[16]."""
    return struct.pack("<IIQQIIQII16s", BPF_PROG_TYPE_CGROUP_DEVICE, insn_count, insns_address, license_address,
                       0, 0, 0, 0, 0, name[:15])


def prog_attach_attr(cgroup_fd: int, prog_fd: int) -> bytes:
    """union bpf_attr for BPF_PROG_ATTACH: target_fd, attach_bpf_fd, attach_type, attach_flags."""
    return struct.pack("<IIII", cgroup_fd, prog_fd, BPF_CGROUP_DEVICE, BPF_F_ALLOW_MULTI)


def _bpf(command: int, attr: bytes) -> int:
    number = SYS_BPF.get(platform.machine())
    if number is None:
        raise IsolationError(f"no bpf(2) system call number known for {platform.machine()}")
    libc = ctypes.CDLL(None, use_errno=True)
    buffer = ctypes.create_string_buffer(attr, len(attr))
    result = libc.syscall(ctypes.c_long(number), ctypes.c_int(command), buffer, ctypes.c_uint(len(attr)))
    if result < 0:
        error = ctypes.get_errno()
        raise OSError(error, os.strerror(error))
    return result


def attach_device_program(cgroup_dir: Path, program: bytes) -> None:
    """Load ``program`` and attach it to ``cgroup_dir`` (BPF_F_ALLOW_MULTI: it runs with whatever
    else is attached there or above, Slurm's or systemd's, and a device must pass all of them).
    The attachment holds the program; it goes when the cgroup is removed. Needs root (CAP_BPF and
    CAP_SYS_ADMIN) and Linux 4.15+."""
    code = ctypes.create_string_buffer(program, len(program))
    license_text = ctypes.create_string_buffer(b"GPL")
    prog_fd = -1
    dir_fd = os.open(cgroup_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        prog_fd = _bpf(BPF_PROG_LOAD, prog_load_attr(ctypes.addressof(code), len(program) // 8,
                                                     ctypes.addressof(license_text)))
        _bpf(BPF_PROG_ATTACH, prog_attach_attr(dir_fd, prog_fd))
    finally:
        os.close(dir_fd)
        if prog_fd >= 0:
            os.close(prog_fd)


