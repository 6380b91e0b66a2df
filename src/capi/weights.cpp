// The C API's model-directory weights (moeforge.h, "a Hugging Face model directory's weights"): the
// engine's validating safetensors reader (io::ModelWeights) behind a handle.
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "capi/capi_util.h"
#include "io/safetensors.h"
#include "moeforge/moeforge.h"

struct mf_weights {
    explicit mf_weights(mf::io::ModelWeights w) : weights(std::move(w)), names(weights.names()) {}
    mf::io::ModelWeights weights;
    std::vector<std::string> names;  // sorted
};

using mf::capi::guarded;
using mf::capi::refuse;

namespace {

const mf::io::ModelWeights& weights_of(const char* op, const mf_weights* w) {
    if (w == nullptr) refuse(op, ": weights is NULL (open them with mf_weights_open)");
    return w->weights;
}

const mf::io::StTensor& tensor_of(const char* op, const mf_weights* w, const char* name) {
    const mf::io::ModelWeights& weights = weights_of(op, w);
    if (name == nullptr) refuse(op, ": name is NULL");
    const mf::io::StTensor* t = weights.find(name);
    if (t == nullptr)
        refuse(op, ": ", weights.dir().string(), " has no tensor named '", name, "' (mf_weights_name lists them)");
    return *t;
}

}  // namespace

extern "C" {

mf_status mf_weights_open(mf_weights** weights, const char* model_dir) {
    return guarded([&] {
        if (weights == nullptr || model_dir == nullptr) refuse("mf_weights_open: weights and model_dir are required");
        *weights = nullptr;
        *weights = new mf_weights(mf::io::ModelWeights::open(model_dir));
    });
}

mf_status mf_weights_count(const mf_weights* weights, int64_t* count) {
    return guarded([&] {
        weights_of("mf_weights_count", weights);
        if (count == nullptr) refuse("mf_weights_count: count is NULL");
        *count = static_cast<int64_t>(weights->names.size());
    });
}

mf_status mf_weights_name(const mf_weights* weights, int64_t index, char* name, size_t name_bytes, size_t* needed) {
    return guarded([&] {
        weights_of("mf_weights_name", weights);
        if (index < 0 || index >= static_cast<int64_t>(weights->names.size()))
            refuse("mf_weights_name: index ", index, " outside [0, ", weights->names.size(), ")");
        mf::capi::copy_out(weights->names[static_cast<size_t>(index)], name, name_bytes, needed);
    });
}

mf_status mf_weights_info(const mf_weights* weights, const char* name, char* dtype, size_t dtype_bytes, int32_t* ndim,
                          int64_t* shape) {
    return guarded([&] {
        const mf::io::StTensor& t = tensor_of("mf_weights_info", weights, name);
        if (t.shape.size() > MF_MAX_DIMS)
            refuse("mf_weights_info: tensor '", name, "' has ", t.shape.size(), " dimensions (at most ", MF_MAX_DIMS,
                   " are described)");
        if (dtype != nullptr) {
            const char* spelled = mf::io::st_dtype_name(t.dtype);
            if (dtype_bytes <= std::strlen(spelled)) refuse("mf_weights_info: dtype_bytes ", dtype_bytes, " too small");
            std::strcpy(dtype, spelled);
        }
        if (ndim != nullptr) *ndim = static_cast<int32_t>(t.shape.size());
        if (shape != nullptr)
            for (size_t i = 0; i < t.shape.size(); ++i) shape[i] = t.shape[i];
    });
}

mf_status mf_weights_read_f32(const mf_weights* weights, const char* name, const mf_tensor* out) {
    return guarded([&] {
        const mf::io::StTensor& t = tensor_of("mf_weights_read_f32", weights, name);
        mf::capi::OpCall call("mf_weights_read_f32", nullptr);
        const mf::Tensor o = call.tensor(out, "out", mf::capi::Want::f32);
        if (o.device() != mf::Device::cpu) refuse("mf_weights_read_f32: out must be CPU memory");
        if (o.shape() != t.shape)
            refuse("mf_weights_read_f32: out is ", mf::shape_str(o.shape()), ", tensor '", name, "' is ",
                   mf::shape_str(t.shape));
        weights->weights.read_f32(name, t.shape, o.ptr<float>());
    });
}

void mf_weights_free(mf_weights* weights) { delete weights; }

}  // extern "C"
