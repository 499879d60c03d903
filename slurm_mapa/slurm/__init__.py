"""The Slurm integration: what runs in slurmctld's job_submit, on the compute nodes (the hooks and
the node agent) and in the admin's shell. Each sub-package has one role; imports point down
this list only (tests/test_layout.py checks):

* ``admin/``: the admin commands (``mapa status``, ``explain``, ``doctor``, ``release``, and
  ``mapa hooks`` / ``spank-plugin`` / ``job-submit-lua``, which write what Slurm runs);
* ``agent/``: mapa-agent, the resident process on each node: its socket server and client, the
  background passes, node features, metrics, dcgm-exporter's job mapping;
* ``hooks/``: the Prolog and the Epilog (choose, record and release a job's GPUs within a time
  budget), the reconcile pass, the decision in the AdminComment;
* ``isolation/``: confining each task to its GPUs (device cgroups, BPF, the SPANK plugin's checks);
* ``node_state/``: the node's files (claims, job files, marks, the ledger, the journal) behind
  one interface;
* ``config.py`` (mapa.toml) and ``trusted_files.py`` (root-owned paths, writes that cannot be
  redirected): read by all of the above; ``ring_rate_cache.py``: the ring-rate tables of
  topology files, kept on disk through trusted_files;
* ``text/``: Slurm's text and ours, parsed and built by pure functions: the ``#MAPA`` directive
  grammar, scontrol/squeue argument lists and output, the AdminComment decision record.

Below all of them: ``slurm_mapa.core`` (the policies) and ``slurm_mapa.hardware`` (topologies).
"""
