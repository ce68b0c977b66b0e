# The C API's function table (compiled from _capi.pyx).  C callers: include/bnbw_native.h,
# whose bnbw_import() fetches _C_API.
from typing import Any

_C_API: Any  # a PyCapsule named "bnbw_native._capi._C_API"
STATUS: dict[str, int]
