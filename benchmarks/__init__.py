"""Benchmarks. The GPU ones (``moe_block``, ``dsa_layer``, ``fp8_probe``, ``moe_ep``) and
``weight_sync`` run as modules from the repository root (``python -m benchmarks.NAME``),
so they import the project and ``benchmarks.gpu_bench`` without editing ``sys.path``."""
