"""herald's host-side model tools: Qwen3-TTS 12 Hz checkpoint -> herald bundle.

No torch: graphs are built directly with ``onnx.helper`` from the checkpoint's weights.
"""

__version__ = "0.1.0"
