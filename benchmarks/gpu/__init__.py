"""The GPU check: stages measuring correctness, memory, speed and capacity on one GPU (``python -m benchmarks.gpu``)."""
