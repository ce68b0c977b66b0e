# The per-channel arithmetic: where the formulas meet a channel's sums.  Each rule is written
# once, here: the engine's passes call it for every channel, and the torch layers' process
# groups reach the forward's re-centre rule through bnbw_native._engine.
from libc.math cimport sqrt

from bnbw_native._vocabulary cimport OP_TRAINING


cdef inline void coefficients(int op, double sum_g, double sum_xg, double count, float var,
                              float scale, double eps, float mean_low, float *k1, float *k2,
                              float *k3, double *dscale, double *dbias) noexcept nogil:
    """The only place where the formulas meet the sums.  With r = 1/sqrt(var + eps):
        dbias = Sum dy,  dscale = r * Sum (x - mean) dy
        dx = k1*dy + k2*(x - mean) + k3,  k1 = scale*r,
        training: k2 = -scale*r*r*dscale/M,  k3 = -scale*r*dbias/M;  frozen: k2 = k3 = 0.
    The kernels centre on the float mean m; a mean given as m + mean_low (the torch layers'
    exact batch mean) moves the rest into the sums and k3: Sum (x - m - mean_low) dy =
    sum_xg - mean_low * sum_g, and k2*(x - m - mean_low) + k3 = k2*(x - m) + (k3 - k2*mean_low).
    An empty batch (M = 0) has zero parameter gradients, whatever the statistics hold."""
    # (each output is chosen in a local and stored once: with no store under a condition, a
    # loop over channels computes two of them a vector)
    cdef double r = 1.0 / sqrt(<double> var + eps)
    cdef double sr = <double> scale * r
    cdef double low = mean_low
    cdef double ds = 0.0, db = 0.0
    cdef float c2 = 0.0, c3 = 0.0
    if low != 0:                # (never 0 * inf: a mean without a low part changes nothing)
        sum_xg = sum_xg - low * sum_g
    if count > 0:
        db = sum_g
        ds = r * sum_xg
    if op & OP_TRAINING and count > 0:
        c2 = <float> (-sr * r * ds / count)
        c3 = <float> (-sr * sum_g / count)
        if low != 0:
            c3 = <float> (-sr * sum_g / count - <double> c2 * low)
    dbias[0] = db
    dscale[0] = ds
    k1[0] = <float> sr
    k2[0] = c2
    k3[0] = c3


# A channel whose mean lies more than sqrt(RECENTRE) standard deviations from its shift would
# lose log2(RECENTRE) of f64's bits to cancellation in Sum d^2 - (Sum d)^2 / M: its sums are
# taken again around fl32(mean) (forward_recentre).  A decision from the channel's own sums.
cdef enum:
    RECENTRE = 4096


cdef inline bint forward_recentre(float shift, double s1, double s2, double count,
                                  float *new_shift) noexcept nogil:
    """Whether a channel's forward sums around `shift` must be taken again around *new_shift."""
    cdef double off = s1 / count
    cdef float to = <float> (shift + off)
    if not (off * off > RECENTRE * ((s2 - s1 * off) / count)) or to == shift:
        return False          # (NaN and inf sums: never; there is nothing to recover)
    new_shift[0] = to
    return True


cdef inline void forward_coefficients(float shift, double s1, double s2, double count,
                                      float scale, float beta, double eps, float *mean_hi,
                                      float *k, float *b, double *mean,
                                      double *var) noexcept nogil:
    """The only place where the forward's formulas meet its sums (d = x - shift):
        mean = shift + Sum d / M,  var = (Sum d^2 - (Sum d)^2 / M) / M  (biased, >= 0),
        r = 1/sqrt(var + eps),  y = k*(x - mean_hi) + b  with  k = fl32(scale*r),
        mean_hi = fl32(mean),  b = fl32(beta - k*(mean - mean_hi)):
    the mean's low bits, which x - mean_hi cannot see, go into b.  A channel of one value
    (var 0: every x - mean_hi is 0) takes k = 0 for a finite scale, so y = beta even where
    scale*r overflows float32 (inf*0 would be NaN)."""
    cdef double off = s1 / count
    cdef double m2 = s2 - s1 * off
    cdef double m = shift + off
    cdef double v = (0.0 if m2 < 0 else m2) / count
    # k = 0 where var = 0 and the scale is finite, as 0 * r (r = 1/sqrt(eps) is finite there):
    # a select, not a branch around the square root, so a loop over channels takes two a vector
    cdef double sc = scale
    cdef double kept = 0.0 if (v == 0.0) & (sc - sc == 0) else sc
    cdef float kk = <float> (kept * (1.0 / sqrt(v + eps)))
    cdef float hi = <float> m
    mean[0] = m
    var[0] = v
    k[0] = kk
    mean_hi[0] = hi
    b[0] = <float> (beta - <double> kk * (m - <double> hi))


cdef inline double running_statistic(double old, double batch, double momentum, double count,
                                     bint torch_running, bint variance) noexcept nogil:
    """A running mean (or variance) after a batch of M = count > 0 elements, in f64:
    momentum * old + (1 - momentum) * batch; torch_running: PyTorch's
    (1 - momentum) * old + momentum * batch with the variance unbiased (M / (M - 1))."""
    if not torch_running:
        return momentum * old + (1.0 - momentum) * batch
    if variance and count > 1:
        batch = batch * (count / (count - 1.0))
    return (1.0 - momentum) * old + momentum * batch
