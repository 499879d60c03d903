"""The suite's root. Its tests mirror the package (core/, hardware/, calibrate/, slurm/<part>/,
replay/, and cluster/ for the mini Slurm cluster); the tests at this level cover the whole
product (its commands, docs, packaging and layout).

pytest puts this directory on sys.path (it holds no __init__.py), so every test imports the shared
helpers beside this file by name: fake_slurm, fake_node, fake_nvml, fake_amdsmi, bruteforce,
faultsim, line_mutations, repo_paths.
"""
