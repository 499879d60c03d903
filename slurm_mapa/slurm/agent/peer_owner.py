"""Who a TCP connection to the metrics port is from, for its per-peer bound (metrics.MetricsServer).

Every local user connects from 127.0.0.1 (or ::1), so a loopback peer is told apart by the uid
that owns its socket: the socket whose local address is the peer's and whose remote address is
ours. The kernel finds it by that address pair (sock_diag, as ss(8) does): one lookup, whatever
the number of sockets. Where netlink cannot be used, /proc/net/tcp (tcp6) is read instead, up to
PROC_NET_TCP_MAX_BYTES (about 25,000 sockets): any user can grow those tables (each closed
connection leaves a TIME_WAIT line for a minute), so the read is bounded, and a peer not found
within it is told apart by its address only (bounded like any other peer).
"""

from __future__ import annotations

import ipaddress
import socket
import struct
import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

PROC_NET_TCP = "/proc/net/tcp"
PROC_NET_TCP6 = "/proc/net/tcp6"
PROC_NET_TCP_MAX_BYTES = 4 << 20
_TCP_TIME_WAIT = 0x06  # a closed connection's leftover (owned by no user): never the peer's socket
# linux/netlink.h, linux/sock_diag.h, linux/inet_diag.h
_NETLINK_SOCK_DIAG = 4
_SOCK_DIAG_BY_FAMILY = 20
_NLM_F_REQUEST = 0x1
_NLMSG_ERROR = 0x2
_INET_DIAG_NOCOOKIE = 0xFFFFFFFF
_NLMSG_HEADER = struct.Struct("=IHHII")  # len, type, flags, seq, pid
_INET_DIAG_MSG_STATE = 16 + 1  # in the reply: the header, then family, state, ...
_INET_DIAG_MSG_UID = 16 + 4 + 48 + 12  # ... timer, retrans, the 48-byte socket id, expires, rqueue, wqueue, uid
SOCK_DIAG_TIMEOUT_S = 0.5


@dataclass(frozen=True)
class TcpSocket:
    """One line of /proc/net/tcp or /proc/net/tcp6."""

    local: tuple[Any, int]  # (ipaddress address, port); IPv4-mapped IPv6 addresses as IPv4
    remote: tuple[Any, int]
    state: int
    uid: int


def unmapped(address: Any) -> Any:
    """``address`` (an ipaddress address), IPv4 for an IPv4-mapped IPv6 address (::ffff:127.0.0.1):
    a dual-stack socket shows an IPv4 peer so."""
    return getattr(address, "ipv4_mapped", None) or address


def proc_net_address(field: str, byteorder: str = sys.byteorder) -> tuple[Any, int]:
    """An address field of /proc/net/tcp(6), ``HEXADDR:HEXPORT``, as (ipaddress address, port).
    The kernel prints the address as 32-bit words in the host's byte order (IPv4: one word,
    "0100007F" for 127.0.0.1 on x86; IPv6: four) and the port as a number. Raises ValueError."""
    hex_address, hex_port = field.split(":")
    if len(hex_address) not in (8, 32):
        raise ValueError(f"not an address of /proc/net/tcp: {field[:60]!r}")
    words = (int(hex_address[i:i + 8], 16).to_bytes(4, byteorder) for i in range(0, len(hex_address), 8))
    port = int(hex_port, 16)
    if not 0 <= port <= 65535:
        raise ValueError(f"not a port: {hex_port[:10]!r}")
    return unmapped(ipaddress.ip_address(b"".join(words))), port


def proc_net_tcp_line(line: str, byteorder: str = sys.byteorder) -> TcpSocket | None:
    """A line of /proc/net/tcp(6) (``sl local_address rem_address st tx:rx tr:when retrnsmt uid
    ...``); None for the header line or a line that is not one."""
    fields = line.split()
    if len(fields) < 8 or not fields[0].endswith(":"):
        return None
    try:
        return TcpSocket(proc_net_address(fields[1], byteorder), proc_net_address(fields[2], byteorder),
                         int(fields[3], 16), int(fields[7]))
    except ValueError:
        return None


def socket_owner_uid(lines: Iterable[str], local: tuple[Any, int], remote: tuple[Any, int],
                     byteorder: str = sys.byteorder) -> int | None:
    """The uid of the socket among ``lines`` (of /proc/net/tcp or tcp6) whose local address is
    ``local`` and remote address ``remote`` ((ipaddress address, port) each), or None."""
    local, remote = (unmapped(local[0]), local[1]), (unmapped(remote[0]), remote[1])
    for line in lines:
        entry = proc_net_tcp_line(line, byteorder)
        if entry is not None and entry.local == local and entry.remote == remote and entry.state != _TCP_TIME_WAIT:
            return entry.uid
    return None


def bounded_lines(path: str, budget: list[int]) -> Iterator[str]:
    """The lines of ``path`` while ``budget[0]`` (bytes, shared by the tables read for one
    connection) lasts; nothing when it cannot be read."""
    try:
        with open(path, "rb") as table:
            while budget[0] > 0:
                line = table.readline(budget[0])
                if not line:
                    return
                budget[0] -= len(line)
                yield line.decode("ascii", "replace")
    except OSError:
        return


def socket_owner_in_proc(local: tuple[Any, int], remote: tuple[Any, int],
                         tables: tuple[str, str] = (PROC_NET_TCP, PROC_NET_TCP6), max_bytes: int = PROC_NET_TCP_MAX_BYTES) -> int | None:
    """The uid owning the TCP socket from ``local`` to ``remote`` as /proc/net/tcp(6) show it
    (reading ``max_bytes`` at most), or None."""
    budget = [max_bytes]
    # An IPv4 peer's socket is in tcp, or in tcp6 when it is a dual-stack IPv6 socket.
    for table in (tables if unmapped(local[0]).version == 4 else tables[1:]):
        uid = socket_owner_uid(bounded_lines(table, budget), local, remote)
        if uid is not None:
            return uid
    return None


def sock_diag_request(local: tuple[Any, int], remote: tuple[Any, int], sequence: int = 1) -> bytes:
    """The netlink message asking the kernel for the TCP socket from ``local`` to ``remote``
    ((ipaddress address, port) each, of one family): SOCK_DIAG_BY_FAMILY, an inet_diag_req_v2
    naming the exact socket (no dump)."""
    source, destination = unmapped(local[0]), unmapped(remote[0])
    family = socket.AF_INET if source.version == 4 else socket.AF_INET6
    socket_id = (struct.pack("!HH", local[1], remote[1]) + source.packed.ljust(16, b"\0") + destination.packed.ljust(16, b"\0")
                 + struct.pack("=III", 0, _INET_DIAG_NOCOOKIE, _INET_DIAG_NOCOOKIE))
    request = struct.pack("=BBBBI", family, socket.IPPROTO_TCP, 0, 0, 0xFFFFFFFF) + socket_id  # every state
    return _NLMSG_HEADER.pack(_NLMSG_HEADER.size + len(request), _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST, sequence, 0) + request


def sock_diag_uid(reply: bytes, sequence: int = 1) -> int | None:
    """The socket owner's uid in the kernel's reply to :func:`sock_diag_request`; None for an
    error (ENOENT: no such socket), a TIME_WAIT leftover, or a reply that is not one."""
    if len(reply) < _INET_DIAG_MSG_UID + 4:
        return None
    length, kind, _flags, reply_sequence, _pid = _NLMSG_HEADER.unpack_from(reply)
    if kind != _SOCK_DIAG_BY_FAMILY or reply_sequence != sequence or length < _INET_DIAG_MSG_UID + 4 \
            or reply[_INET_DIAG_MSG_STATE] == _TCP_TIME_WAIT:
        return None
    return struct.unpack_from("=I", reply, _INET_DIAG_MSG_UID)[0]


def socket_owner_by_sock_diag(local: tuple[Any, int], remote: tuple[Any, int]) -> int | None:
    """The uid owning the TCP socket from ``local`` to ``remote``, as the kernel's socket lookup
    says (None: no such socket). Raises OSError where netlink's sock_diag cannot be used."""
    with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, _NETLINK_SOCK_DIAG) as netlink:
        netlink.settimeout(SOCK_DIAG_TIMEOUT_S)
        netlink.sendto(sock_diag_request(local, remote), (0, 0))
        return sock_diag_uid(netlink.recv(8192))


def loopback_socket_owner(local: tuple[Any, int], remote: tuple[Any, int]) -> int | None:
    """The uid owning the socket from ``local`` to ``remote``: the kernel's lookup, or where it
    cannot be used, /proc/net/tcp(6)."""
    try:
        return socket_owner_by_sock_diag(local, remote)
    except OSError:
        return socket_owner_in_proc(local, remote)


def ip_of(host: Any) -> Any:
    """The address of a socket address's host ("127.0.0.1", "::1", "fe80::1%eth0"), IPv4-mapped as
    IPv4. Raises ValueError."""
    return unmapped(ipaddress.ip_address(str(host)))


def peer_of_connection(client_address: Any, local_address: Any,
                       owner: Callable[[tuple[Any, int], tuple[Any, int]], int | None] = loopback_socket_owner) -> tuple[str, Any]:
    """Who a connection accepted at ``local_address`` from ``client_address`` is from, for the
    per-peer bound: ("uid", N) for a loopback peer whose socket ``owner`` says uid N owns; else
    ("address", the peer's address). Raises ValueError or IndexError on an address that is not
    one (the server then keys the connection by its raw address)."""
    peer, ours = (ip_of(client_address[0]), int(client_address[1])), (ip_of(local_address[0]), int(local_address[1]))
    if peer[0].is_loopback and peer[0].version == ours[0].version:
        uid = owner(peer, ours)
        if uid is not None:
            return "uid", uid
    return "address", str(peer[0])
