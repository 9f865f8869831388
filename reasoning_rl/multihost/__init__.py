"""Runs that span processes (hosts): JAX's multi-controller runtime, the role of each process
(trainer, sampler or both), host-side messages between processes, and the device-to-device weight
sync from the trainer slice to the sampler replicas. See docs/multihost.md."""
