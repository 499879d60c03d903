"""What an admin runs: ``mapa status`` and ``mapa explain`` (``status``), ``mapa doctor``
(``doctor/``), ``mapa release`` (``release``: on the controller, starts placement=require jobs when a good node is free), and
``mapa hooks``, ``mapa spank-plugin`` and ``mapa job-submit-lua`` (``install``: the files Slurm
runs), and ``mapa contrib`` (``contrib``: the files an admin puts in place, the Grafana dashboard,
the Prometheus rules and the gres.conf of every preset).

May import every other part of ``slurm_mapa.slurm``; nothing there imports it.
"""
