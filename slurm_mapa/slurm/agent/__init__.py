"""mapa-agent, the resident process on each GPU node (``service.main``): it runs the Prolog and
Epilog for the wrappers' client (``client``, stdlib only, run as a script), isolates tasks for
the TaskProlog and the SPANK plugin (``server``: the sockets and the protocol), and in the
background (``background``) reconciles the node, writes the journal's AdminComment records,
publishes node features (``features``), dcgm-exporter's job mapping (``dcgm``) and serves
Prometheus metrics (``metrics``).

May import: ``hooks``, ``isolation``, ``node_state``, ``config``, ``trusted_files``, ``text``,
``slurm_mapa.core`` and ``slurm_mapa.hardware``; ``client`` imports nothing of the project.
"""
