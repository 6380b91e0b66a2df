#include "ops/attention_decode.h"

#include "kernels/cpu/attention_decode.h"

namespace mf::ops {

bool attention_decode_supported(Device device) { return device == Device::cpu; }

void attention_decode_forward(const Tensor& out, const Tensor& q, const Tensor& k, const Tensor& v, int64_t first,
                              int64_t num_heads, int64_t num_kv_heads) {
    MF_CHECK(num_heads > 0 && num_kv_heads > 0 && q.ndim() == 2 && q.dim(1) % num_heads == 0, "attention_decode: q ",
             shape_str(q.shape()), " with ", num_heads, " heads");
    const int64_t n = q.dim(0), D = q.dim(1) / num_heads;
    MF_CHECK(
        first >= 0 && out.numel() == q.numel() && k.numel() == (first + n) * num_kv_heads * D && v.numel() == k.numel(),
        "attention_decode shapes: q ", shape_str(q.shape()), " k ", shape_str(k.shape()), " v ", shape_str(v.shape()),
        " out ", shape_str(out.shape()), " first ", first);
    for (const Tensor* t : {&q, &k, &v})
        MF_CHECK(t->device() == out.device(), "attention_decode mixes cpu and cuda tensors");
    MF_CHECK(attention_decode_supported(out.device()), "attention_decode has no ", device_name(out.device()),
             " kernel (model/generate.h runs attention_forward over the prefix there)");
    cpu::attention_decode_forward(out.ptr<float>(), q.ptr<float>(), k.ptr<float>(), v.ptr<float>(),
                                  {n, first, num_heads, num_kv_heads, D});
}

}  // namespace mf::ops
