"""Slurm's text and MAPA's, parsed and built by pure functions tested on literal output: the
``#MAPA`` directive grammar (``directive``), the argument lists of scontrol and squeue and readers
of what they print (``commands``), and the decision record MAPA keeps in the AdminComment
(``decision``). No I/O here: the callers run the commands.

May import: ``slurm_mapa.core`` (a directive becomes a core Request) and ``slurm_mapa.errors``.
"""
