"""Pure-Python core: groups, the mutation barrier, the buffer, the sampler and the controller.

Nothing here imports grpc, opentelemetry, fastapi or vllm; what happens is reported as plain data
through :class:`rolloutd.domain.observer.Observer`.
"""
