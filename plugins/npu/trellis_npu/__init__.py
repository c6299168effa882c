"""Ascend NPU support for Trellis. Importing it imports neither torch nor torch_npu.

The device backend is :class:`trellis_npu.backend.NPUBackend`, registered as ``npu`` in
``trellis.device_backends``.
"""

__version__ = "0.1.0"
