"""DirectML ``DML_OPERATOR_BATCH_NORMALIZATION_GRAD`` and ``..._TRAINING_GRAD``.

Descriptors mirror ``DML_BUFFER_TENSOR_DESC``; operators are compiled once (every check runs
then) and executed many times on raw memory::

    from bnbw_native import dml
    x = dml.TensorDesc("float32", (32, 64, 56, 56))
    stats = dml.TensorDesc("float32", (1, 64, 1, 1))
    op = dml.BatchNormalizationTrainingGrad(
        input=x, input_gradient=x, mean=stats, variance=stats, scale=stats,
        output_gradient=x, output_scale_gradient=stats, output_bias_gradient=stats,
        epsilon=1e-5)
    op.execute(input=x_buf, input_gradient=dy_buf, mean=m_buf, variance=v_buf, scale=g_buf,
               output_gradient=dx_buf, output_scale_gradient=dg_buf,
               output_bias_gradient=db_buf)

DirectML's InputGradient is dy and OutputGradient is dx.  Sums run over the dims where the
mean/variance/scale sizes are 1.  ``BatchNormalizationGrad`` keeps the statistics frozen (the
seed's formulas); ``BatchNormalizationTrainingGrad`` gives the full training gradient.

DirectML's vocabulary - the members, the descriptor rules, the operators and how buffers are
bound - lives in ``bnbw_native._directml`` (nogil code that the C API of
``include/bnbw_native.h`` shares); this module is its Python face: descriptors and operators as
Python objects, and array conveniences that go through the validation layer every array
convention uses.  Refusals are ``TypeError`` (data types, wrong kinds of objects) or
``ValueError`` (everything else).
"""

import numpy as np

from . import _arrays, _directml
from ._rules import check_flag, check_int

__all__ = [
    "TensorDesc",
    "BatchNormalizationGrad",
    "BatchNormalizationTrainingGrad",
    "BatchNormalizationTraining",
    "batch_normalization_grad",
    "batch_normalization_training_grad",
]

MEMBERS = _directml.MEMBERS      # input, input_gradient, mean, variance, scale, output_...
DATA_TYPES = ("float32", "float16", "bfloat16")


def _data_type(value):
    """The canonical name of a data type given as a name or a NumPy / ml_dtypes dtype."""
    if isinstance(value, str):
        name = value
    else:
        try:
            name = np.dtype(value).name if value is not None else None
        except TypeError:
            name = None
    if name not in DATA_TYPES:
        raise TypeError(f"data_type must be 'float32', 'float16' or 'bfloat16', got {value!r}")
    return name


def _int_tuple(values, name):
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise TypeError(f"{name} must be a sequence of ints, got {type(values).__name__}")
    return tuple(check_int(v, f"{name}[{i}]") for i, v in enumerate(values))


class TensorDesc:
    """``DML_BUFFER_TENSOR_DESC``: a data type, 1 to 8 sizes, strides in elements.

    data_type: "float32", "float16" or "bfloat16" (or the NumPy / ml_dtypes dtype).
    sizes: positive ints.  strides: non-negative ints in **elements** (0 = broadcast), or None
    for packed row-major.  total_tensor_size_in_bytes: at least the minimum size
    (sum (size - 1) * stride + 1) * item size; None gives the minimum rounded up to 4 bytes.
    A buffer bound at execute time needs only the minimum size.  Immutable; equal when the data
    type, sizes, element strides and total size are."""

    __slots__ = ("_data_type", "_sizes", "_strides", "_total", "_minimum", "_element_strides")

    def __init__(self, data_type, sizes, strides=None, total_tensor_size_in_bytes=None):
        data_type = _data_type(data_type)
        sizes = _int_tuple(sizes, "sizes")
        if strides is not None:
            strides = _int_tuple(strides, "strides")
            if len(strides) != len(sizes):
                raise ValueError(f"strides must have one entry per dimension ({len(sizes)}), "
                                 f"got {len(strides)}")
        total = total_tensor_size_in_bytes
        if total is not None:
            total = check_int(total, "total_tensor_size_in_bytes")
        minimum, total, element_strides = _directml.tensor_sizes(
            (_directml.DATA_TYPES[data_type], sizes, strides, total))
        for slot, value in (("_data_type", data_type), ("_sizes", sizes), ("_strides", strides),
                            ("_total", total), ("_minimum", minimum),
                            ("_element_strides", element_strides)):
            object.__setattr__(self, slot, value)

    @classmethod
    def from_array(cls, array, data_type=None):
        """The descriptor of a NumPy array's memory (non-negative strides that are multiples of
        the item size).  data_type overrides the array's dtype, e.g. "bfloat16" for uint16 bit
        patterns."""
        if not isinstance(array, np.ndarray):
            raise TypeError(f"array must be a NumPy array, got {type(array).__name__}")
        data_type = _data_type(array.dtype if data_type is None else data_type)
        itemsize = _directml.ITEMSIZES[data_type]
        if array.dtype.itemsize != itemsize:
            raise TypeError(f"array has {array.dtype.itemsize}-byte items, data_type "
                            f"{data_type} needs {itemsize}")
        # a size-1 dim's stride never matters (NumPy may give it any value)
        strides = [0 if n == 1 and (s < 0 or s % itemsize) else s
                   for n, s in zip(array.shape, array.strides)]
        if any(s < 0 or s % itemsize for s in strides):
            raise ValueError(f"strides must be non-negative multiples of the item size, got "
                             f"byte strides {array.strides}")
        return cls(data_type, array.shape, tuple(s // itemsize for s in strides))

    def __setattr__(self, name, value):
        raise AttributeError("TensorDesc is immutable")

    def __reduce__(self):
        return (TensorDesc, (self._data_type, self._sizes, self._strides, self._total))

    def __delattr__(self, name):
        raise AttributeError("TensorDesc is immutable")

    @property
    def data_type(self):
        return self._data_type

    @property
    def sizes(self):
        return self._sizes

    @property
    def strides(self):
        """The strides as given (None = packed)."""
        return self._strides

    @property
    def element_strides(self):
        """The strides in elements, packed ones filled in."""
        return self._element_strides

    @property
    def dimension_count(self):
        return len(self._sizes)

    @property
    def total_tensor_size_in_bytes(self):
        return self._total

    @property
    def minimum_size_in_bytes(self):
        """What a bound buffer must hold: (sum (size - 1) * stride + 1) * item size."""
        return self._minimum

    @property
    def itemsize(self):
        return _directml.ITEMSIZES[self._data_type]

    def _key(self):
        return (self._data_type, self._sizes, self._element_strides, self._total)

    def _spec(self):
        return (_directml.DATA_TYPES[self._data_type], self._sizes, self._strides, self._total)

    def __eq__(self, other):
        if not isinstance(other, TensorDesc):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self):
        return hash(self._key())

    def __repr__(self):
        return (f"TensorDesc(data_type={self._data_type!r}, sizes={self._sizes}, "
                f"strides={self._strides}, total_tensor_size_in_bytes={self._total})")


class _Operator:
    """An operator compiled once; execute() binds memory and runs it (GIL released).

    Its signatures name the members for callers; what they are given is read back by name in
    the order of the member table (_table: _directml's rows of name, slot, role)."""

    _type = None
    _table = ()
    feature_level = None

    def _compile(self, given, epsilon, **options):
        """Check and plan once: given maps (at least) the member names to descriptors."""
        descs = {name: given[name] for name, _, _ in self._table}
        for name, _, role in self._table:
            if descs[name] is None and role == "optional":
                continue
            if not isinstance(descs[name], TensorDesc):
                raise TypeError(f"{name} must be a bnbw_native.dml.TensorDesc, got "
                                f"{type(descs[name]).__name__}")
        self._op = _directml.Operator(self._type, [None if d is None else d._spec()
                                                   for d in descs.values()], epsilon, **options)
        self._descs = descs

    def _run(self, given, num_threads):
        """Bind the buffers given by member name, in member order, and run."""
        self._op.execute([given[name] for name, _, _ in self._table], num_threads)

    @property
    def epsilon(self):
        """The f32 epsilon, as a float."""
        return self._op.epsilon

    @property
    def plan_kind(self):
        """The engine's plan: "channel-last" (channels are the unit-stride inner dim),
        "channel-major" or "empty"."""
        return self._op.kind

    @property
    def count(self):
        """M: the elements summed per statistics element."""
        return self._op.count

    def __getattr__(self, name):
        descs = self.__dict__.get("_descs")
        if descs is not None and name in descs:
            return descs[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __repr__(self):
        members = ", ".join(f"{k}={v!r}" for k, v in self._descs.items())
        return f"{type(self).__name__}({members}, epsilon={self.epsilon!r})"


class _GradOperator(_Operator):
    _table = _directml.GRAD_TABLE

    def __init__(self, *, input, input_gradient, mean, variance, scale, output_gradient,
                 output_scale_gradient, output_bias_gradient, epsilon):
        self._compile(locals(), epsilon)

    def execute(self, *, input, input_gradient, mean, variance, scale, output_gradient,
                output_scale_gradient, output_bias_gradient, num_threads=None):
        """Bind one buffer per member and run.

        Each buffer: a buffer-protocol object (bytes, bytearray, memoryview, ctypes array, NumPy
        array of any dtype, read as raw contiguous memory; writable for the outputs) holding at
        least the descriptor's minimum size, or a positive int address (trusted).  Output
        buffers must not overlap each other nor the inputs, except output_gradient over
        input_gradient with identical descriptors (in place).  Returns None."""
        self._run(locals(), num_threads)


class BatchNormalizationGrad(_GradOperator):
    """``DML_OPERATOR_BATCH_NORMALIZATION_GRAD`` (DML_FEATURE_LEVEL_3_1): frozen statistics.

    With r = 1/sqrt(variance + epsilon), sums over the dims where mean's size is 1:
    output_gradient = input_gradient * scale * r;
    output_scale_gradient = sum(input_gradient * (input - mean)) * r;
    output_bias_gradient = sum(input_gradient)."""

    _type = "grad"
    feature_level = "DML_FEATURE_LEVEL_3_1"


class BatchNormalizationTrainingGrad(_GradOperator):
    """``DML_OPERATOR_BATCH_NORMALIZATION_TRAINING_GRAD`` (DML_FEATURE_LEVEL_4_1): the training
    gradient, through the batch statistics (mean is used).

    Parameter gradients as BatchNormalizationGrad; with M elements per statistics element,
    output_gradient = scale * r * (input_gradient - output_bias_gradient / M
                                   - (input - mean) * r * output_scale_gradient / M)."""

    _type = "training_grad"
    feature_level = "DML_FEATURE_LEVEL_4_1"


class BatchNormalizationTraining(_Operator):
    """The training forward over descriptors (oneDNN Graph's ``BatchNormForwardTraining``; the
    C API's create_training_operator), with M elements summed per statistics element and
    m = momentum, the weight of the OLD running statistics:

    output_batch_mean = sum(input) / M;  output_batch_variance = sum((input - batch_mean)^2) / M;
    output = scale * (input - batch_mean) / sqrt(batch_variance + epsilon) + bias (then ReLU
    when fuse_relu, NaN kept);  output_running_mean = m * mean + (1 - m) * batch_mean, and the
    variance alike.  scale and bias may be None (1 and 0).  Descriptors as for the gradient
    operators: one data type, input and output one set of sizes, the per-channel ones mean's."""

    _type = "training"
    _table = _directml.TRAINING_TABLE

    def __init__(self, *, input, mean, variance, output, output_running_mean,
                 output_running_variance, output_batch_mean, output_batch_variance, scale=None,
                 bias=None, epsilon, momentum=0.5, fuse_relu=False):
        check_flag(fuse_relu, "fuse_relu")
        self._compile(locals(), epsilon, momentum=momentum, fuse_relu=bool(fuse_relu))
        self._fuse_relu = bool(fuse_relu)

    def execute(self, *, input, mean, variance, output, output_running_mean,
                output_running_variance, output_batch_mean, output_batch_variance, scale=None,
                bias=None, num_threads=None):
        """Bind one buffer per member (None for a scale or bias the operator was made without)
        and run.  Buffers as for the gradient operators; outputs may not overlap each other nor
        the inputs, except output over input, output_running_mean over mean and
        output_running_variance over variance, each at the same address with identical
        descriptors (in place).  Returns None."""
        self._run(locals(), num_threads)

    @property
    def momentum(self):
        """The f32 momentum, as a float."""
        return self._op.momentum

    @property
    def fuse_relu(self):
        return self._fuse_relu


# ---- array conveniences -------------------------------------------------------------------

def batch_normalization_grad(input, input_gradient, mean, variance, scale, epsilon, *,
                             num_threads=None):
    """BatchNormalizationGrad on NumPy arrays: frozen statistics.

    input, input_gradient: one shape, rank 1 to 8, any strides (negative included); mean,
    variance, scale: the DirectML layout, same rank with size 1 on the summed dims and the
    input's size elsewhere.  Every array float32, float16 or bfloat16 (ml_dtypes), all the same.
    Returns (output_gradient, output_scale_gradient, output_bias_gradient): output_gradient laid
    out like input, the others shaped like mean."""
    return _array_grad(_arrays.FROZEN, input, input_gradient, mean, variance, scale, epsilon,
                       num_threads)


def batch_normalization_training_grad(input, input_gradient, mean, variance, scale, epsilon, *,
                                      num_threads=None):
    """BatchNormalizationTrainingGrad on NumPy arrays: the training gradient.  Arguments and
    results as batch_normalization_grad."""
    return _array_grad(_arrays.TRAINING, input, input_gradient, mean, variance, scale, epsilon,
                       num_threads)


def _array_grad(formula, input, input_gradient, mean, variance, scale, epsilon, num_threads):
    return _arrays.backward(_directml.CONVENTION, formula, input, input_gradient, mean, variance,
                          scale, epsilon, None, None, num_threads)
