"""The exceptions moeforge raises: one class per status of the C API (include/moeforge/moeforge.h),
each carrying the engine's message (which names the op, the argument, file or field, and the
problem)."""


class Error(RuntimeError):
    """Any moeforge failure."""


class InvalidArgumentError(Error, ValueError):
    """A bad tensor, shape, value, recipe or model input (MF_ERR_INVALID_ARGUMENT)."""


class UnsupportedError(Error, NotImplementedError):
    """Valid, but not supported here, e.g. a CUDA tensor in a build without CUDA (MF_ERR_UNSUPPORTED)."""


class CudaError(Error):
    """A CUDA, cuBLAS, cuDNN or NCCL call failed (MF_ERR_CUDA)."""


class IoError(Error, OSError):
    """A file could not be read or written (MF_ERR_IO)."""


class InternalError(Error):
    """Anything else: a bug in moeforge (MF_ERR_INTERNAL); please report it with the message."""
