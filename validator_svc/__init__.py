"""The validator service: the acceptance rule (acceptance.py), its CUDA kernel (kernel.py) and
acceptance-by-entropy statistics (entropy.py). Domain modules here never import grpc."""
