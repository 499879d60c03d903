"""Confining each task to its GPUs (docs/isolation.md): which device numbers a job's task may
open (``rules``), applied through cgroup v1's devices controller or a cgroup v2 BPF program
(``cgroups``, ``bpf``), for a request from the TaskProlog or the SPANK plugin (``isolator``);
and the checks of the SPANK plugin's build against the running Slurm (``spank_plugin``).

May import: ``node_state`` (a job's GPUs), ``config``, ``trusted_files``, ``text`` and
``slurm_mapa.hardware``.
"""
