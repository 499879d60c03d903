"""The hooks slurmd runs as root for every job, through the wrappers ``mapa hooks`` writes:

* ``prolog``: choose the job's GPUs and record them, within a time budget (``budget``), failing
  open and safe; its phases read the job (``job_context``, ``job_cpus``) and the node
  (``node_graph``), decide with the core policies, claim and record through ``node_state``, and
  journal the decision for the AdminComment (``admin_comment``);
* ``epilog``: release the job's GPUs and device cgroups;
* ``reconcile``: bring the node's state in line with the jobs Slurm says run here (off the start
  path: in mapa-agent, or in a Prolog when no agent runs).

The entry points are ``prolog.prolog_main`` and ``epilog.epilog_main``; mapa-agent calls
``prolog_failing_open`` and ``epilog_failing_open`` in-process.

May import: ``node_state``, ``isolation`` (the Epilog removes device cgroups), ``config``,
``trusted_files``, ``text``, ``slurm_mapa.core`` and ``slurm_mapa.hardware``.
"""
