"""A fixed fingerprint shared by tests (a module of its own: tests/store has a conftest too)."""

# A fixed fingerprint: tests about storage must not depend on the machine running them.
FACTS = {
    "os": "linux", "arch": "x86_64", "python": "3.11", "torch.version": "2.13.0+cpu",
    "cpu.isa": "avx512", "cpu.model": "Test CPU", "cpu.threads": "2", "cxx.name": "g++",
    "gpu.name": "none", "gpu.sm": "none", "gpu.count": "0", "gpu.driver": "none", "model.id": "test-model",
}  # fmt: skip
