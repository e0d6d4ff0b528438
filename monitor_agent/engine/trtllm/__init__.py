"""The TensorRT-LLM engine (the ``tensorrt`` extra): :mod:`.mapping` turns iserve's
configuration into LLM API arguments, :mod:`.engine` serves them behind the PyTorch
engine's interface through the streaming core in :mod:`.core`, :mod:`.selection` picks a
worker's engine from ``ISERVE_ENGINE``.

``tensorrt_llm`` is imported only inside :class:`.engine.TrtLlmEngine`'s constructor, so
importing this package never needs it.
"""
