"""`mapa calibrate`: measure a GPU server with nccl-tests and fit an effective-bandwidth model."""
