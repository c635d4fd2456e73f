// v41jax host-table row gather: an XLA FFI custom call for the CPU backend.
//
// rows[n, :] = dequantise(table[ids[n], :])  -> float32 [N, dim]
//
// The table lives in host memory (a numpy array or a memory-mapped file) at the address in
// the `data` attribute; the Python side keeps it alive and read-only while programs that
// embed the address exist. Formats (`kind`):
//   0  float32 rows
//   1  bfloat16 rows                       (exact: the 16 bits become the f32's high half)
//   2  float8_e4m3fn rows x float32 row scale at `scale` [num_rows]
//   3  float8_e4m3fn rows x 2^(e - 127), e the uint8 UE8M0 exponent of each block of `block`
//      values, at `scale` [num_rows, dim / block]
// fp8 values decode through `lut` [256] (numpy's own conversion, so results match the host
// gather bit for bit); each product is one float32 multiply, as numpy's.
// Why native: a jax.pure_callback costs a trip into Python per call, which on XLA:CPU is
// several times the gather itself at decode batch sizes.
#include <cstdint>
#include <cstring>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

static inline float bits_to_float(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

static ffi::Error HostGatherImpl(ffi::Buffer<ffi::S32> ids, ffi::Buffer<ffi::F32> lut,
                                 ffi::ResultBuffer<ffi::F32> out, uint64_t data, uint64_t scale,
                                 int64_t num_rows, int64_t dim, int64_t kind, int64_t block) {
  const int32_t* id = ids.typed_data();
  const float* lut_f = lut.typed_data();
  float* dst = out->typed_data();
  const size_t n = ids.element_count();
  if (out->element_count() != n * static_cast<size_t>(dim)) {
    return ffi::Error::InvalidArgument("host_gather: output is not [N, dim]");
  }
  if (kind == 3 && (block <= 0 || dim % block != 0)) {
    return ffi::Error::InvalidArgument("host_gather: block must divide dim");
  }
  for (size_t i = 0; i < n; ++i) {
    const int64_t r = id[i];
    if (r < 0 || r >= num_rows) {
      return ffi::Error(ffi::ErrorCode::kOutOfRange,
                        "host_gather: row id " + std::to_string(r) + " outside [0, " +
                            std::to_string(num_rows) + ")");
    }
    float* o = dst + i * dim;
    if (kind == 0) {
      std::memcpy(o, reinterpret_cast<const float*>(data) + r * dim, dim * sizeof(float));
    } else if (kind == 1) {
      const uint16_t* src = reinterpret_cast<const uint16_t*>(data) + r * dim;
      for (int64_t c = 0; c < dim; ++c) o[c] = bits_to_float(uint32_t(src[c]) << 16);
    } else if (kind == 2) {
      const uint8_t* src = reinterpret_cast<const uint8_t*>(data) + r * dim;
      const float s = reinterpret_cast<const float*>(scale)[r];
      for (int64_t c = 0; c < dim; ++c) o[c] = lut_f[src[c]] * s;
    } else if (kind == 3) {
      const uint8_t* src = reinterpret_cast<const uint8_t*>(data) + r * dim;
      const uint8_t* exps = reinterpret_cast<const uint8_t*>(scale) + r * (dim / block);
      for (int64_t c = 0; c < dim; ++c) {
        o[c] = lut_f[src[c]] * bits_to_float(uint32_t(exps[c / block]) << 23);
      }
    } else {
      return ffi::Error::InvalidArgument("host_gather: unknown kind " + std::to_string(kind));
    }
  }
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(V41jaxHostGather, HostGatherImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<uint64_t>("data")
                                  .Attr<uint64_t>("scale")
                                  .Attr<int64_t>("num_rows")
                                  .Attr<int64_t>("dim")
                                  .Attr<int64_t>("kind")
                                  .Attr<int64_t>("block"));
