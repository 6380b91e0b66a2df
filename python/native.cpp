// moeforge._native: the Python face of the C API (include/moeforge/moeforge.h), and nothing else
// of the engine: every call goes through an mf_* function. No framework headers: arrays arrive as
// DLPack (an object with __dlpack__, such as a numpy array or a torch tensor, or a "dltensor"
// capsule) or as a RawTensor (a data pointer with dtype, shape and device), and outputs are the
// caller's. A failed call raises the exception class of its status (moeforge.errors), carrying the
// engine's message. The GIL is released while an op or an engine step runs.
//
// DLPack (the data interchange standard of the array libraries) is read and written through its
// published C ABI, declared below: DLManagedTensor { DLTensor; manager context; deleter }.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cmath>
#include <cstring>
#include <deque>
#include <string>
#include <vector>

#include "moeforge/moeforge.h"

namespace py = pybind11;
using namespace pybind11::literals;

namespace {

// --- DLPack's C ABI --------------------------------------------------------------------------------
struct DLDevice {
    int32_t device_type;  // 1: CPU, 2: CUDA, 3: CUDA host memory
    int32_t device_id;
};
struct DLDataType {
    uint8_t code;  // 0: int, 1: uint, 2: float, 4: bfloat
    uint8_t bits;
    uint16_t lanes;
};
struct DLTensor {
    void* data;
    DLDevice device;
    int32_t ndim;
    DLDataType dtype;
    int64_t* shape;
    int64_t* strides;  // in elements; NULL: compact row-major
    uint64_t byte_offset;
};
struct DLManagedTensor {
    DLTensor dl_tensor;
    void* manager_ctx;
    void (*deleter)(DLManagedTensor* self);
};
constexpr int32_t kDLCPU = 1, kDLCUDA = 2, kDLCUDAHost = 3;

// --- errors ----------------------------------------------------------------------------------------
// The exception class of each status, set by moeforge.errors at import (set_error_classes).
py::object g_error_classes[6];

[[noreturn]] void raise(mf_status status, const std::string& message) {
    const int index = status >= MF_ERR_INVALID_ARGUMENT && status <= MF_ERR_INTERNAL ? status : MF_ERR_INTERNAL;
    py::handle cls = g_error_classes[index] ? g_error_classes[index] : py::handle(PyExc_RuntimeError);
    PyErr_SetString(cls.ptr(), message.c_str());
    throw py::error_already_set();
}

// Runs a C API call without the GIL; raises on failure.
template <typename F>
void call(F&& f) {
    mf_status status;
    {
        py::gil_scoped_release released;
        status = f();
    }
    if (status != MF_OK) raise(status, mf_last_error());
}

[[noreturn]] void refuse(const std::string& message) { raise(MF_ERR_INVALID_ARGUMENT, message); }

// --- tensors in ------------------------------------------------------------------------------------

// A tensor given by a raw data pointer.
struct RawTensor {
    uintptr_t data = 0;
    std::string dtype;  // "float32", "bfloat16", "int32", "int64", "float64"
    std::vector<int64_t> shape;
    std::string device = "cpu";  // "cpu" or "cuda"
    int device_index = 0;
};

int32_t dtype_from_name(const std::string& name, const char* arg) {
    if (name == "float32" || name == "f32") return MF_F32;
    if (name == "bfloat16" || name == "bf16") return MF_BF16;
    if (name == "int32" || name == "i32") return MF_I32;
    if (name == "int64" || name == "i64") return MF_I64;
    if (name == "float64" || name == "f64") return MF_F64;
    refuse(std::string(arg) + ": dtype '" + name + "' (expected float32, bfloat16, int32, int64 or float64)");
}

int32_t dtype_from_dlpack(const DLDataType& t, const char* arg) {
    if (t.lanes == 1) {
        if (t.code == 2 && t.bits == 32) return MF_F32;
        if (t.code == 2 && t.bits == 64) return MF_F64;
        if (t.code == 4 && t.bits == 16) return MF_BF16;
        if (t.code == 0 && t.bits == 32) return MF_I32;
        if (t.code == 0 && t.bits == 64) return MF_I64;
    }
    refuse(std::string(arg) + ": DLPack dtype (code " + std::to_string(t.code) + ", " + std::to_string(t.bits) +
           " bits, " + std::to_string(t.lanes) + " lanes) is not one of float32, bfloat16, int32, int64, float64");
}

// Array types read through their own methods rather than DLPack (a registered type, such as
// torch.Tensor registered by moeforge.hf): a few attribute reads instead of a capsule per tensor.
// Such an array has data_ptr(), dtype (one of the registered dtype objects), shape, stride() in
// elements, and is_cuda / is_cpu with get_device() (the CUDA ordinal).
struct ArrayType {
    py::object cls;
    std::vector<std::pair<py::object, int32_t>> dtypes;  // the type's dtype objects, compared by identity
};
std::vector<ArrayType>& g_array_types = *new std::vector<ArrayType>();  // (never destroyed: outlives the interpreter)

const ArrayType* array_type_of(py::handle obj) {
    for (const ArrayType& t : g_array_types)
        if (PyObject_IsInstance(obj.ptr(), t.cls.ptr()) == 1) return &t;
    return nullptr;
}

// One op's tensor arguments, each converted to an mf_tensor that stays valid (and whose memory
// stays alive: the capsule or array is held) until the call returns.
class Args {
 public:
    // nullptr for None.
    const mf_tensor* get(py::handle obj, const char* name, bool optional = false) {
        if (obj.is_none()) {
            if (!optional) refuse(std::string(name) + " is required (got None)");
            return nullptr;
        }
        Slot& s = slots_.emplace_back();
        s.t = mf_tensor{};
        if (py::isinstance<RawTensor>(obj)) {
            from_raw(obj.cast<const RawTensor&>(), name, s);
        } else if (const ArrayType* type = array_type_of(obj)) {
            from_array(obj, *type, name, s);
        } else {
            py::object capsule = py::reinterpret_borrow<py::object>(obj);
            if (!PyCapsule_CheckExact(obj.ptr())) {
                if (!py::hasattr(obj, "__dlpack__"))
                    refuse(std::string(name) + ": a " + std::string(py::str(py::type::of(obj).attr("__name__"))) +
                           " is neither a DLPack array (no __dlpack__), a DLPack capsule nor a moeforge.RawTensor");
                capsule = dlpack_of(obj);
            }
            from_capsule(capsule, name, s);
        }
        return &s.t;
    }
    const mf_tensor* opt(py::handle obj, const char* name) { return get(obj, name, true); }

 private:
    struct Slot {
        mf_tensor t;
        std::vector<int64_t> strides;
        py::object keep;
    };

    // CUDA arrays are asked for their capsule without a stream handshake (stream -1): the op runs on
    // the stream the caller names in the context, which the caller orders with its own work.
    static py::object dlpack_of(py::handle obj) {
        if (py::hasattr(obj, "__dlpack_device__")) {
            const py::tuple device = obj.attr("__dlpack_device__")();
            if (device[0].cast<int>() == kDLCUDA) return obj.attr("__dlpack__")("stream"_a = -1);
        }
        return obj.attr("__dlpack__")();
    }

    static void from_raw(const RawTensor& r, const char* name, Slot& s) {
        s.t.data = reinterpret_cast<void*>(r.data);
        s.t.dtype = dtype_from_name(r.dtype, name);
        if (r.device != "cpu" && r.device != "cuda")
            refuse(std::string(name) + ": device '" + r.device + "' (expected cpu or cuda)");
        s.t.device_type = r.device == "cuda" ? MF_CUDA : MF_CPU;
        s.t.device_index = r.device_index;
        if (r.shape.size() > MF_MAX_DIMS)
            refuse(std::string(name) + ": " + std::to_string(r.shape.size()) + " dimensions (at most " +
                   std::to_string(MF_MAX_DIMS) + ")");
        s.t.ndim = static_cast<int32_t>(r.shape.size());
        std::copy(r.shape.begin(), r.shape.end(), s.t.shape);
    }

    static void from_array(py::handle obj, const ArrayType& type, const char* name, Slot& s) {
        const py::object dtype = obj.attr("dtype");
        s.t.dtype = -1;
        for (const auto& [object, code] : type.dtypes)
            if (object.ptr() == dtype.ptr()) s.t.dtype = code;
        if (s.t.dtype < 0)
            refuse(std::string(name) + ": dtype " + std::string(py::str(dtype)) +
                   " (expected float32, bfloat16, int32, int64 or float64)");
        if (obj.attr("is_cuda").cast<bool>()) {
            s.t.device_type = MF_CUDA;
            s.t.device_index = obj.attr("get_device")().cast<int32_t>();
        } else if (obj.attr("is_cpu").cast<bool>()) {
            s.t.device_type = MF_CPU;
        } else {
            refuse(std::string(name) + ": device " + std::string(py::str(obj.attr("device"))) +
                   " (moeforge reads CPU and CUDA memory)");
        }
        const py::tuple shape = obj.attr("shape");
        const py::tuple strides = obj.attr("stride")();
        if (shape.size() > MF_MAX_DIMS || strides.size() != shape.size())
            refuse(std::string(name) + ": " + std::to_string(shape.size()) + " dimensions (at most " +
                   std::to_string(MF_MAX_DIMS) + ")");
        s.t.ndim = static_cast<int32_t>(shape.size());
        s.strides.resize(shape.size());
        for (size_t i = 0; i < shape.size(); ++i) {
            s.t.shape[i] = shape[i].cast<int64_t>();
            s.strides[i] = strides[i].cast<int64_t>();
        }
        s.t.strides = s.strides.data();
        s.t.data = reinterpret_cast<void*>(obj.attr("data_ptr")().cast<uintptr_t>());
        s.keep = py::reinterpret_borrow<py::object>(obj);
    }

    static void from_capsule(py::object capsule, const char* name, Slot& s) {
        if (std::strcmp(PyCapsule_GetName(capsule.ptr()), "dltensor") != 0)
            refuse(std::string(name) + ": the DLPack capsule was already consumed");
        auto* managed = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule.ptr(), "dltensor"));
        if (managed == nullptr) throw py::error_already_set();
        const DLTensor& dl = managed->dl_tensor;
        if (dl.device.device_type != kDLCPU && dl.device.device_type != kDLCUDA && dl.device.device_type != kDLCUDAHost)
            refuse(std::string(name) + ": DLPack device type " + std::to_string(dl.device.device_type) +
                   " (moeforge reads CPU and CUDA memory)");
        if (dl.ndim < 0 || dl.ndim > MF_MAX_DIMS)
            refuse(std::string(name) + ": " + std::to_string(dl.ndim) + " dimensions (at most " +
                   std::to_string(MF_MAX_DIMS) + ")");
        s.t.data = static_cast<char*>(dl.data) + dl.byte_offset;
        s.t.dtype = dtype_from_dlpack(dl.dtype, name);
        s.t.device_type = dl.device.device_type == kDLCUDA ? MF_CUDA : MF_CPU;
        s.t.device_index = dl.device.device_id;
        s.t.ndim = dl.ndim;
        for (int i = 0; i < dl.ndim; ++i) s.t.shape[i] = dl.shape[i];
        if (dl.strides != nullptr) {
            s.strides.assign(dl.strides, dl.strides + dl.ndim);
            s.t.strides = s.strides.data();
        }
        s.keep = std::move(capsule);  // the capsule's destructor calls the producer's deleter
    }

    std::deque<Slot> slots_;  // stable addresses
};

// The execution context: None (the CPU, or the engine's stream), or a moeforge.Context.
struct Context {
    int device = -1;
    uint64_t stream = 0;
    py::object workspace = py::none();
};

class ContextArg {
 public:
    const mf_context* get(py::handle obj, Args& args) {
        if (obj.is_none()) return nullptr;
        const Context& c = obj.cast<const Context&>();
        ctx_.device = c.device;
        ctx_.stream = c.stream;
        if (const mf_tensor* ws = args.opt(c.workspace, "Context.workspace")) {
            ctx_.workspace = ws->data;
            size_t bytes = ws->dtype == MF_BF16 ? 2 : ws->dtype == MF_F64 || ws->dtype == MF_I64 ? 8 : 4;
            for (int i = 0; i < ws->ndim; ++i) bytes *= static_cast<size_t>(ws->shape[i]);
            ctx_.workspace_bytes = bytes;
        }
        return &ctx_;
    }

 private:
    mf_context ctx_{};
};

// --- tensors out: zero-copy views of the engine's parameters ----------------------------------------

void release_view(PyObject* owner);  // Engine's: one view fewer (it may free the engine)

// A DLPack producer over memory the engine owns: __dlpack__ hands out a capsule whose deleter
// releases a reference to `owner` (the engine), so the memory outlives every consumer's array.
void acquire_view(PyObject* owner);

// A view counts as a use of the engine for as long as it lives, and so does every capsule it hands
// out (a consumer's array may outlive the view).
struct View {
    mf_tensor t{};
    py::object owner;

    View(const mf_tensor& tensor, py::object engine) : t(tensor), owner(std::move(engine)) {
        acquire_view(owner.ptr());
    }
    ~View() { release_view(owner.ptr()); }
    View(const View&) = delete;
    View& operator=(const View&) = delete;

    // The Python buffer protocol (numpy.asarray: a writable zero-copy array), CPU memory only.
    py::buffer_info buffer() const {
        if (t.device_type != MF_CPU) refuse("a CUDA tensor has no host buffer: use DLPack (torch.from_dlpack)");
        const char* format = nullptr;
        ssize_t item = 4;
        switch (t.dtype) {
            case MF_F32:
                format = "f";
                break;
            case MF_I32:
                format = "i";
                break;
            case MF_I64:
                format = "q", item = 8;
                break;
            case MF_F64:
                format = "d", item = 8;
                break;
            default:
                refuse("a bfloat16 tensor has no buffer format: use DLPack (torch.from_dlpack)");
        }
        std::vector<ssize_t> shape(t.shape, t.shape + t.ndim), strides(static_cast<size_t>(t.ndim));
        ssize_t stride = item;
        for (int i = t.ndim - 1; i >= 0; --i) {
            strides[static_cast<size_t>(i)] = stride;
            stride *= static_cast<ssize_t>(t.shape[i]);
        }
        return py::buffer_info(t.data, item, format, t.ndim, shape, strides);
    }

    struct Managed {
        DLManagedTensor managed;
        std::vector<int64_t> shape;
        PyObject* owner;
    };

    static void delete_managed(DLManagedTensor* self) {
        auto* m = static_cast<Managed*>(self->manager_ctx);
        PyGILState_STATE gil = PyGILState_Ensure();
        release_view(m->owner);
        Py_XDECREF(m->owner);
        PyGILState_Release(gil);
        delete m;
    }

    static void capsule_destructor(PyObject* capsule) {
        // An unconsumed capsule still owns its tensor.
        if (std::strcmp(PyCapsule_GetName(capsule), "dltensor") != 0) return;
        auto* managed = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule, "dltensor"));
        if (managed != nullptr) managed->deleter(managed);
    }

    py::tuple dlpack_device() const {
        return py::make_tuple(t.device_type == MF_CUDA ? kDLCUDA : kDLCPU,
                              t.device_type == MF_CUDA ? t.device_index : 0);
    }

    py::object dlpack(py::object stream) const {
        (void)stream;  // the engine's work on its tensors is finished when a step returns
        auto* m = new Managed;
        m->shape.assign(t.shape, t.shape + t.ndim);
        m->owner = owner.ptr();
        Py_XINCREF(m->owner);
        acquire_view(m->owner);
        DLTensor& dl = m->managed.dl_tensor;
        dl.data = t.data;
        dl.device = {t.device_type == MF_CUDA ? kDLCUDA : kDLCPU, t.device_type == MF_CUDA ? t.device_index : 0};
        dl.ndim = t.ndim;
        switch (t.dtype) {
            case MF_F32:
                dl.dtype = {2, 32, 1};
                break;
            case MF_BF16:
                dl.dtype = {4, 16, 1};
                break;
            case MF_I32:
                dl.dtype = {0, 32, 1};
                break;
            case MF_I64:
                dl.dtype = {0, 64, 1};
                break;
            default:
                dl.dtype = {2, 64, 1};
                break;
        }
        dl.shape = m->shape.data();
        dl.strides = nullptr;
        dl.byte_offset = 0;
        m->managed.manager_ctx = m;
        m->managed.deleter = &View::delete_managed;
        PyObject* capsule = PyCapsule_New(&m->managed, "dltensor", &View::capsule_destructor);
        if (capsule == nullptr) {
            delete_managed(&m->managed);
            throw py::error_already_set();
        }
        return py::reinterpret_steal<py::object>(capsule);
    }
};

// The names behind a C API pair of "how many" and "the i-th name" (each name asked for twice: its
// size, then it): the engine's parameters, a model directory's tensors.
template <typename Count, typename Name>
std::vector<std::string> names_of(const Count& count_of, const Name& name_of) {
    int64_t count = 0;
    call([&] { return count_of(&count); });
    std::vector<std::string> names;
    for (int64_t i = 0; i < count; ++i) {
        size_t needed = 0;
        call([&] { return name_of(i, nullptr, 0, &needed); });
        std::vector<char> name(needed);
        call([&] { return name_of(i, name.data(), name.size(), &needed); });
        names.emplace_back(name.data());
    }
    return names;
}

// --- the engine ------------------------------------------------------------------------------------

class Engine {
 public:
    Engine(const std::string& recipe, bool is_text, const std::string& base_dir,
           const std::vector<std::string>& overrides, const std::string& resume, bool force_resume) {
        std::vector<const char*> argv;
        for (const std::string& s : overrides) argv.push_back(s.c_str());
        call([&] {
            return mf_engine_open(&engine_, recipe.c_str(), is_text ? 1 : 0, base_dir.c_str(), argv.data(),
                                  static_cast<int64_t>(argv.size()), resume.c_str(), force_resume ? 1 : 0);
        });
    }
    ~Engine() { close(); }

    // No call after close(); the engine's memory goes when the last view of it does (a numpy array
    // of a parameter keeps it, and OUT's lock, alive).
    void close() {
        closed_ = true;
        free_when_unused();
    }
    void acquire_view() { ++live_views_; }
    void release_view() {
        --live_views_;
        free_when_unused();
    }

    py::dict step() {
        mf_step_metrics m{};
        call([&] { return mf_engine_step(handle(), &m); });
        return py::dict("step"_a = m.step, "loss"_a = m.loss, "ce_loss"_a = m.ce_loss, "aux_loss"_a = m.aux_loss,
                        "grad_norm"_a = m.grad_norm, "lr"_a = m.lr, "tokens"_a = m.tokens,
                        "tokens_per_s"_a = m.tokens_per_s, "peak_mem_gib"_a = m.peak_mem_gib,
                        "step_seconds"_a = m.step_seconds, "skipped"_a = m.skipped != 0,
                        "val_loss"_a = m.val_loss >= 0 ? py::object(py::float_(m.val_loss)) : py::object(py::none()));
    }

    py::tuple progress() {
        int64_t done = 0, total = 0;
        int32_t interrupted = 0;
        call([&] { return mf_engine_progress(handle(), &done, &total, &interrupted); });
        return py::make_tuple(done, total, interrupted);
    }

    void save_checkpoint() {
        call([&] { return mf_engine_save_checkpoint(handle()); });
    }

    std::string export_model() {
        std::vector<char> out(4096);
        call([&] { return mf_engine_export(handle(), out.data(), out.size()); });
        return out.data();
    }

    std::string recipe_json() {
        size_t needed = 0;
        call([&] { return mf_engine_recipe_json(handle(), nullptr, 0, &needed); });
        std::vector<char> text(needed);
        call([&] { return mf_engine_recipe_json(handle(), text.data(), text.size(), &needed); });
        return text.data();
    }

    std::vector<std::string> param_names() {
        return names_of([&](int64_t* count) { return mf_engine_num_params(handle(), count); },
                        [&](int64_t i, char* name, size_t bytes, size_t* needed) {
                            return mf_engine_param_name(handle(), i, name, bytes, needed);
                        });
    }

    mf_tensor param(const std::string& name, bool gradient) {
        mf_tensor t{};
        call([&] { return mf_engine_param(handle(), name.c_str(), gradient ? 1 : 0, &t); });
        return t;
    }

 private:
    mf_engine* handle() const {
        if (engine_ == nullptr || closed_) refuse("the engine is closed");
        return engine_;
    }
    void free_when_unused() {
        if (!closed_ || live_views_ > 0 || engine_ == nullptr) return;
        py::gil_scoped_release released;
        mf_engine_free(engine_);
        engine_ = nullptr;
    }
    mf_engine* engine_ = nullptr;
    bool closed_ = false;
    int64_t live_views_ = 0;
};

void acquire_view(PyObject* owner) { py::handle(owner).cast<Engine&>().acquire_view(); }
// Called from a DLPack deleter, which must not throw.
void release_view(PyObject* owner) {
    try {
        py::handle(owner).cast<Engine&>().release_view();
    } catch (...) {
    }
}

// --- a model directory's weights -------------------------------------------------------------------

class Weights {
 public:
    explicit Weights(const std::string& model_dir) {
        call([&] { return mf_weights_open(&weights_, model_dir.c_str()); });
    }
    ~Weights() { close(); }
    Weights(const Weights&) = delete;
    Weights& operator=(const Weights&) = delete;

    void close() {
        mf_weights_free(weights_);
        weights_ = nullptr;
    }

    std::vector<std::string> names() {
        return names_of([&](int64_t* count) { return mf_weights_count(handle(), count); },
                        [&](int64_t i, char* name, size_t bytes, size_t* needed) {
                            return mf_weights_name(handle(), i, name, bytes, needed);
                        });
    }

    // (stored dtype, shape)
    py::tuple info(const std::string& name) {
        char dtype[16] = {};
        int32_t ndim = 0;
        int64_t shape[MF_MAX_DIMS] = {};
        call([&] { return mf_weights_info(handle(), name.c_str(), dtype, sizeof(dtype), &ndim, shape); });
        py::tuple dims(ndim);
        for (int32_t i = 0; i < ndim; ++i) dims[i] = shape[i];
        return py::make_tuple(std::string(dtype), dims);
    }

    void read_f32(const std::string& name, py::object out) {
        Args args;
        const mf_tensor* o = args.get(out, "out");
        call([&] { return mf_weights_read_f32(handle(), name.c_str(), o); });
    }

 private:
    const mf_weights* handle() const {
        if (weights_ == nullptr) refuse("the weights are closed");
        return weights_;
    }
    mf_weights* weights_ = nullptr;
};

// --- ops -------------------------------------------------------------------------------------------
// Each binding converts its tensors, then calls the mf_* function of the same name without the GIL.
#define MF_TENSOR(name) args.get(name, #name)
#define MF_OPTIONAL(name) args.opt(name, #name)

void bind_ops(py::module_& m) {
    const auto ctx_arg = "ctx"_a = py::none();
    m.def(
        "grouped_gemm_forward",
        [](py::object out, py::object inp, py::object weight, py::object offsets, py::object ctx) {
            Args args;
            ContextArg c;
            const mf_context* cx = c.get(ctx, args);
            const auto *o = MF_TENSOR(out), *x = MF_TENSOR(inp), *w = MF_TENSOR(weight), *off = MF_TENSOR(offsets);
            call([&] { return mf_grouped_gemm_forward(cx, o, x, w, off); });
        },
        "out"_a, "inp"_a, "weight"_a, "offsets"_a, ctx_arg);
    m.def(
        "grouped_gemm_input_grad",
        [](py::object dinp, py::object dout, py::object weight, py::object offsets, bool accumulate, py::object ctx) {
            Args args;
            ContextArg c;
            const mf_context* cx = c.get(ctx, args);
            const auto *dx = MF_TENSOR(dinp), *dy = MF_TENSOR(dout), *w = MF_TENSOR(weight), *off = MF_TENSOR(offsets);
            call([&] { return mf_grouped_gemm_input_grad(cx, dx, dy, w, off, accumulate ? 1 : 0); });
        },
        "dinp"_a, "dout"_a, "weight"_a, "offsets"_a, "accumulate"_a = false, ctx_arg);
    m.def(
        "grouped_gemm_weight_grad",
        [](py::object dweight, py::object dout, py::object inp, py::object offsets, bool accumulate, py::object ctx) {
            Args args;
            ContextArg c;
            const mf_context* cx = c.get(ctx, args);
            const auto *dw = MF_TENSOR(dweight), *dy = MF_TENSOR(dout), *x = MF_TENSOR(inp), *off = MF_TENSOR(offsets);
            call([&] { return mf_grouped_gemm_weight_grad(cx, dw, dy, x, off, accumulate ? 1 : 0); });
        },
        "dweight"_a, "dout"_a, "inp"_a, "offsets"_a, "accumulate"_a = false, ctx_arg);
    m.def(
        "router_softmax_topk_forward",
        [](py::object probs, py::object topk_idx, py::object topk_weight, py::object logits, bool norm_topk_prob,
           py::object ctx) {
            Args args;
            ContextArg c;
            const mf_context* cx = c.get(ctx, args);
            const auto *p = MF_TENSOR(probs), *i = MF_TENSOR(topk_idx), *w = MF_TENSOR(topk_weight);
            const auto* l = MF_TENSOR(logits);
            call([&] { return mf_router_softmax_topk_forward(cx, p, i, w, l, norm_topk_prob ? 1 : 0); });
        },
        "probs"_a, "topk_idx"_a, "topk_weight"_a, "logits"_a, "norm_topk_prob"_a, ctx_arg);
    m.def(
        "router_softmax_topk_backward",
        [](py::object dlogits, py::object dtopk_weight, py::object dprobs, py::object probs, py::object topk_idx,
           bool norm_topk_prob, py::object ctx) {
            Args args;
            ContextArg c;
            const mf_context* cx = c.get(ctx, args);
            const auto *dl = MF_TENSOR(dlogits), *dw = MF_TENSOR(dtopk_weight), *dp = MF_OPTIONAL(dprobs);
            const auto *p = MF_TENSOR(probs), *i = MF_TENSOR(topk_idx);
            call([&] { return mf_router_softmax_topk_backward(cx, dl, dw, dp, p, i, norm_topk_prob ? 1 : 0); });
        },
        "dlogits"_a, "dtopk_weight"_a, "dprobs"_a, "probs"_a, "topk_idx"_a, "norm_topk_prob"_a, ctx_arg);
    m.def(
        "router_sigmoid_forward",
        [](py::object scores, py::object topk_idx, py::object topk_weight, py::object logits,
           py::object correction_bias, int64_t n_group, int64_t topk_group, bool norm_topk_prob, float scaling,
           float masked_score, py::object ctx) {
            Args args;
            ContextArg c;
            const mf_context* cx = c.get(ctx, args);
            const auto *s = MF_TENSOR(scores), *i = MF_TENSOR(topk_idx), *w = MF_TENSOR(topk_weight);
            const auto *l = MF_TENSOR(logits), *b = MF_OPTIONAL(correction_bias);
            call([&] {
                return mf_router_sigmoid_forward(cx, s, i, w, l, b, n_group, topk_group, norm_topk_prob ? 1 : 0,
                                                 scaling, masked_score);
            });
        },
        "scores"_a, "topk_idx"_a, "topk_weight"_a, "logits"_a, "correction_bias"_a = py::none(), "n_group"_a = 1,
        "topk_group"_a = 1, "norm_topk_prob"_a = true, "routed_scaling_factor"_a = 1.0f, "masked_score"_a = -INFINITY,
        ctx_arg);
    m.def(
        "router_sigmoid_backward",
        [](py::object dlogits, py::object dtopk_weight, py::object scores, py::object topk_idx, bool norm_topk_prob,
           float scaling, py::object ctx) {
            Args args;
            ContextArg c;
            const mf_context* cx = c.get(ctx, args);
            const auto *dl = MF_TENSOR(dlogits), *dw = MF_TENSOR(dtopk_weight), *s = MF_TENSOR(scores);
            const auto* i = MF_TENSOR(topk_idx);
            call([&] { return mf_router_sigmoid_backward(cx, dl, dw, s, i, norm_topk_prob ? 1 : 0, scaling); });
        },
        "dlogits"_a, "dtopk_weight"_a, "scores"_a, "topk_idx"_a, "norm_topk_prob"_a = true,
        "routed_scaling_factor"_a = 1.0f, ctx_arg);
    m.def(
        "moe_permute_indices",
        [](py::object expert_offsets, py::object sorted_pair, py::object pair_row, py::object topk_idx,
           int64_t num_experts, py::object ctx) {
            Args args;
            ContextArg c;
            const mf_context* cx = c.get(ctx, args);
            const auto *off = MF_TENSOR(expert_offsets), *sp = MF_TENSOR(sorted_pair), *pr = MF_TENSOR(pair_row);
            const auto* i = MF_TENSOR(topk_idx);
            call([&] { return mf_moe_permute_indices(cx, off, sp, pr, i, num_experts); });
        },
        "expert_offsets"_a, "sorted_pair"_a, "pair_row"_a, "topk_idx"_a, "num_experts"_a, ctx_arg);
    m.def(
        "moe_aux_stats",
        [](py::object counts, py::object prob_sums, py::object topk_idx, py::object probs, py::object mask,
           py::object ctx) {
            Args args;
            ContextArg c;
            const mf_context* cx = c.get(ctx, args);
            const auto *tc = MF_TENSOR(counts), *tps = MF_TENSOR(prob_sums), *idx = MF_TENSOR(topk_idx);
            const auto *p = MF_TENSOR(probs), *m = MF_TENSOR(mask);
            call([&] { return mf_moe_aux_stats(cx, tc, tps, idx, p, m); });
        },
        "counts"_a, "prob_sums"_a, "topk_idx"_a, "probs"_a, "mask"_a, ctx_arg);
    m.def(
        "moe_aux_dprobs",
        [](py::object dprobs, py::object counts, py::object mask, float scale, py::object ctx) {
            Args args;
            ContextArg c;
            const mf_context* cx = c.get(ctx, args);
            const auto *dp = MF_TENSOR(dprobs), *tc = MF_TENSOR(counts), *m = MF_TENSOR(mask);
            call([&] { return mf_moe_aux_dprobs(cx, dp, tc, m, scale); });
        },
        "dprobs"_a, "counts"_a, "mask"_a, "scale"_a, ctx_arg);
    m.def(
        "group_offsets",
        [](py::object offsets, py::object group_sizes, int64_t num_rows, py::object ctx) {
            Args args;
            ContextArg c;
            const mf_context* cx = c.get(ctx, args);
            const auto *off = MF_TENSOR(offsets), *sizes = MF_TENSOR(group_sizes);
            call([&] { return mf_group_offsets(cx, off, sizes, num_rows); });
        },
        "offsets"_a, "group_sizes"_a, "num_rows"_a, ctx_arg);
    m.def(
        "zero_rows_past_groups",
        [](py::object x, py::object offsets, py::object ctx) {
            Args args;
            ContextArg c;
            const mf_context* cx = c.get(ctx, args);
            const auto *tx = MF_TENSOR(x), *off = MF_TENSOR(offsets);
            call([&] { return mf_zero_rows_past_groups(cx, tx, off); });
        },
        "x"_a, "offsets"_a, ctx_arg);
    m.def(
        "moe_gather",
        [](py::object x_perm, py::object x, py::object sorted_pair, int64_t top_k, py::object ctx) {
            Args args;
            ContextArg c;
            const mf_context* cx = c.get(ctx, args);
            const auto *xp = MF_TENSOR(x_perm), *xt = MF_TENSOR(x), *sp = MF_TENSOR(sorted_pair);
            call([&] { return mf_moe_gather(cx, xp, xt, sp, top_k); });
        },
        "x_perm"_a, "x"_a, "sorted_pair"_a, "top_k"_a, ctx_arg);
    m.def(
        "moe_gather_backward",
        [](py::object dx, py::object dx_perm, py::object pair_row, int64_t top_k, py::object ctx) {
            Args args;
            ContextArg c;
            const mf_context* cx = c.get(ctx, args);
            const auto *d = MF_TENSOR(dx), *dp = MF_TENSOR(dx_perm), *pr = MF_TENSOR(pair_row);
            call([&] { return mf_moe_gather_backward(cx, d, dp, pr, top_k); });
        },
        "dx"_a, "dx_perm"_a, "pair_row"_a, "top_k"_a, ctx_arg);
    m.def(
        "moe_unpermute",
        [](py::object out, py::object y_perm, py::object topk_weight, py::object pair_row, py::object ctx) {
            Args args;
            ContextArg c;
            const mf_context* cx = c.get(ctx, args);
            const auto *o = MF_TENSOR(out), *yp = MF_TENSOR(y_perm), *w = MF_TENSOR(topk_weight);
            const auto* pr = MF_TENSOR(pair_row);
            call([&] { return mf_moe_unpermute(cx, o, yp, w, pr); });
        },
        "out"_a, "y_perm"_a, "topk_weight"_a, "pair_row"_a, ctx_arg);
    m.def(
        "moe_unpermute_backward",
        [](py::object dy_perm, py::object dtopk_weight, py::object dout, py::object y_perm, py::object topk_weight,
           py::object pair_row, py::object ctx) {
            Args args;
            ContextArg c;
            const mf_context* cx = c.get(ctx, args);
            const auto *dyp = MF_TENSOR(dy_perm), *dw = MF_TENSOR(dtopk_weight), *dy = MF_TENSOR(dout);
            const auto *yp = MF_TENSOR(y_perm), *w = MF_TENSOR(topk_weight), *pr = MF_TENSOR(pair_row);
            call([&] { return mf_moe_unpermute_backward(cx, dyp, dw, dy, yp, w, pr); });
        },
        "dy_perm"_a, "dtopk_weight"_a, "dout"_a, "y_perm"_a, "topk_weight"_a, "pair_row"_a, ctx_arg);
    m.def(
        "swiglu_forward",
        [](py::object out, py::object inp, py::object ctx) {
            Args args;
            ContextArg c;
            const mf_context* cx = c.get(ctx, args);
            const auto *o = MF_TENSOR(out), *x = MF_TENSOR(inp);
            call([&] { return mf_swiglu_forward(cx, o, x); });
        },
        "out"_a, "inp"_a, ctx_arg);
    m.def(
        "swiglu_backward",
        [](py::object dinp, py::object dout, py::object inp, py::object ctx) {
            Args args;
            ContextArg c;
            const mf_context* cx = c.get(ctx, args);
            const auto *dx = MF_TENSOR(dinp), *dy = MF_TENSOR(dout), *x = MF_TENSOR(inp);
            call([&] { return mf_swiglu_backward(cx, dx, dy, x); });
        },
        "dinp"_a, "dout"_a, "inp"_a, ctx_arg);
    m.def(
        "relu2_forward",
        [](py::object out, py::object inp, py::object ctx) {
            Args args;
            ContextArg c;
            const mf_context* cx = c.get(ctx, args);
            const auto *o = MF_TENSOR(out), *x = MF_TENSOR(inp);
            call([&] { return mf_relu2_forward(cx, o, x); });
        },
        "out"_a, "inp"_a, ctx_arg);
    m.def(
        "relu2_backward",
        [](py::object dinp, py::object dout, py::object inp, py::object ctx) {
            Args args;
            ContextArg c;
            const mf_context* cx = c.get(ctx, args);
            const auto *dx = MF_TENSOR(dinp), *dy = MF_TENSOR(dout), *x = MF_TENSOR(inp);
            call([&] { return mf_relu2_backward(cx, dx, dy, x); });
        },
        "dinp"_a, "dout"_a, "inp"_a, ctx_arg);
    m.def(
        "clamped_swiglu_forward",
        [](py::object out, py::object inp, float alpha, float limit, py::object ctx) {
            Args args;
            ContextArg c;
            const mf_context* cx = c.get(ctx, args);
            const auto *o = MF_TENSOR(out), *x = MF_TENSOR(inp);
            call([&] { return mf_clamped_swiglu_forward(cx, o, x, alpha, limit); });
        },
        "out"_a, "inp"_a, "alpha"_a = 1.702f, "limit"_a = 7.0f, ctx_arg);
    m.def(
        "clamped_swiglu_backward",
        [](py::object dinp, py::object dout, py::object inp, float alpha, float limit, py::object ctx) {
            Args args;
            ContextArg c;
            const mf_context* cx = c.get(ctx, args);
            const auto *dx = MF_TENSOR(dinp), *dy = MF_TENSOR(dout), *x = MF_TENSOR(inp);
            call([&] { return mf_clamped_swiglu_backward(cx, dx, dy, x, alpha, limit); });
        },
        "dinp"_a, "dout"_a, "inp"_a, "alpha"_a = 1.702f, "limit"_a = 7.0f, ctx_arg);
    m.def(
        "attention_forward",
        [](py::object out, py::object lse, py::object q, py::object k, py::object v, py::object doc_ids, int64_t batch,
           int64_t seq_len, int64_t num_heads, int64_t num_kv_heads, py::object ctx) {
            Args args;
            ContextArg c;
            const mf_context* cx = c.get(ctx, args);
            const auto *o = MF_TENSOR(out), *l = MF_TENSOR(lse), *tq = MF_TENSOR(q), *tk = MF_TENSOR(k);
            const auto *tv = MF_TENSOR(v), *docs = MF_OPTIONAL(doc_ids);
            call([&] {
                return mf_attention_forward(cx, o, l, tq, tk, tv, docs, batch, seq_len, num_heads, num_kv_heads);
            });
        },
        "out"_a, "lse"_a, "q"_a, "k"_a, "v"_a, "doc_ids"_a, "batch"_a, "seq_len"_a, "num_heads"_a, "num_kv_heads"_a,
        ctx_arg);
    m.def(
        "attention_backward",
        [](py::object dq, py::object dk, py::object dv, py::object dout, py::object q, py::object k, py::object v,
           py::object out, py::object lse, py::object doc_ids, int64_t batch, int64_t seq_len, int64_t num_heads,
           int64_t num_kv_heads, py::object ctx) {
            Args args;
            ContextArg c;
            const mf_context* cx = c.get(ctx, args);
            const auto *tdq = MF_TENSOR(dq), *tdk = MF_TENSOR(dk), *tdv = MF_TENSOR(dv), *tdo = MF_TENSOR(dout);
            const auto *tq = MF_TENSOR(q), *tk = MF_TENSOR(k), *tv = MF_TENSOR(v), *o = MF_TENSOR(out);
            const auto *l = MF_TENSOR(lse), *docs = MF_OPTIONAL(doc_ids);
            call([&] {
                return mf_attention_backward(cx, tdq, tdk, tdv, tdo, tq, tk, tv, o, l, docs, batch, seq_len, num_heads,
                                             num_kv_heads);
            });
        },
        "dq"_a, "dk"_a, "dv"_a, "dout"_a, "q"_a, "k"_a, "v"_a, "out"_a, "lse"_a, "doc_ids"_a, "batch"_a, "seq_len"_a,
        "num_heads"_a, "num_kv_heads"_a, ctx_arg);
    m.def(
        "embedding_forward",
        [](py::object out, py::object ids, py::object wte, py::object ctx) {
            Args args;
            ContextArg c;
            const mf_context* cx = c.get(ctx, args);
            const auto *o = MF_TENSOR(out), *i = MF_TENSOR(ids), *w = MF_TENSOR(wte);
            call([&] { return mf_embedding_forward(cx, o, i, w); });
        },
        "out"_a, "ids"_a, "wte"_a, ctx_arg);
    m.def(
        "embedding_backward",
        [](py::object dwte, py::object dout, py::object ids, py::object ctx) {
            Args args;
            ContextArg c;
            const mf_context* cx = c.get(ctx, args);
            const auto *dw = MF_TENSOR(dwte), *dy = MF_TENSOR(dout), *i = MF_TENSOR(ids);
            call([&] { return mf_embedding_backward(cx, dw, dy, i); });
        },
        "dwte"_a, "dout"_a, "ids"_a, ctx_arg);
    m.def(
        "embedding_backward_workspace_bytes",
        [](int64_t num_rows, int64_t vocab, const std::string& device) {
            size_t bytes = 0;
            call([&] {
                return mf_embedding_backward_workspace_bytes(num_rows, vocab, device == "cuda" ? MF_CUDA : MF_CPU,
                                                             &bytes);
            });
            return bytes;
        },
        "num_rows"_a, "vocab"_a, "device"_a = "cpu");
    m.def(
        "rmsnorm_forward",
        [](py::object out, py::object rstd, py::object inp, py::object weight, float eps, py::object ctx) {
            Args args;
            ContextArg c;
            const mf_context* cx = c.get(ctx, args);
            const auto *o = MF_TENSOR(out), *r = MF_TENSOR(rstd), *x = MF_TENSOR(inp), *w = MF_TENSOR(weight);
            call([&] { return mf_rmsnorm_forward(cx, o, r, x, w, eps); });
        },
        "out"_a, "rstd"_a, "inp"_a, "weight"_a, "eps"_a, ctx_arg);
    m.def(
        "rmsnorm_backward",
        [](py::object dinp, py::object dweight, py::object dout, py::object inp, py::object weight, py::object rstd,
           bool accumulate_dinp, py::object ctx) {
            Args args;
            ContextArg c;
            const mf_context* cx = c.get(ctx, args);
            const auto *dx = MF_TENSOR(dinp), *dw = MF_TENSOR(dweight), *dy = MF_TENSOR(dout);
            const auto *x = MF_TENSOR(inp), *w = MF_TENSOR(weight), *r = MF_TENSOR(rstd);
            call([&] { return mf_rmsnorm_backward(cx, dx, dw, dy, x, w, r, accumulate_dinp ? 1 : 0); });
        },
        "dinp"_a, "dweight"_a, "dout"_a, "inp"_a, "weight"_a, "rstd"_a, "accumulate_dinp"_a = true, ctx_arg);
    m.def(
        "qknorm_rope_forward",
        [](py::object q_out, py::object k_out, py::object q_rstd, py::object k_rstd, py::object q, py::object k,
           py::object q_weight, py::object k_weight, py::object cos, py::object sin, float eps, py::object ctx) {
            Args args;
            ContextArg c;
            const mf_context* cx = c.get(ctx, args);
            const auto *qo = MF_TENSOR(q_out), *ko = MF_TENSOR(k_out), *qr = MF_TENSOR(q_rstd), *kr = MF_TENSOR(k_rstd);
            const auto *tq = MF_TENSOR(q), *tk = MF_TENSOR(k), *qw = MF_TENSOR(q_weight), *kw = MF_TENSOR(k_weight);
            const auto *tc = MF_TENSOR(cos), *ts = MF_TENSOR(sin);
            call([&] { return mf_qknorm_rope_forward(cx, qo, ko, qr, kr, tq, tk, qw, kw, tc, ts, eps); });
        },
        "q_out"_a, "k_out"_a, "q_rstd"_a, "k_rstd"_a, "q"_a, "k"_a, "q_weight"_a, "k_weight"_a, "cos"_a, "sin"_a,
        "eps"_a, ctx_arg);
    m.def(
        "qknorm_rope_backward",
        [](py::object dq, py::object dk, py::object dq_weight, py::object dk_weight, py::object dq_out,
           py::object dk_out, py::object q, py::object k, py::object q_weight, py::object k_weight, py::object q_rstd,
           py::object k_rstd, py::object cos, py::object sin, py::object ctx) {
            Args args;
            ContextArg c;
            const mf_context* cx = c.get(ctx, args);
            const auto *tdq = MF_TENSOR(dq), *tdk = MF_TENSOR(dk), *dqw = MF_TENSOR(dq_weight);
            const auto *dkw = MF_TENSOR(dk_weight), *gq = MF_TENSOR(dq_out), *gk = MF_TENSOR(dk_out);
            const auto *tq = MF_TENSOR(q), *tk = MF_TENSOR(k), *qw = MF_TENSOR(q_weight), *kw = MF_TENSOR(k_weight);
            const auto *qr = MF_TENSOR(q_rstd), *kr = MF_TENSOR(k_rstd), *tc = MF_TENSOR(cos), *ts = MF_TENSOR(sin);
            call([&] {
                return mf_qknorm_rope_backward(cx, tdq, tdk, dqw, dkw, gq, gk, tq, tk, qw, kw, qr, kr, tc, ts);
            });
        },
        "dq"_a, "dk"_a, "dq_weight"_a, "dk_weight"_a, "dq_out"_a, "dk_out"_a, "q"_a, "k"_a, "q_weight"_a,
        "k_weight"_a, "q_rstd"_a, "k_rstd"_a, "cos"_a, "sin"_a, ctx_arg);
    m.def(
        "lm_head_cross_entropy",
        [](py::object losses, py::object dh, py::object dw, py::object h, py::object w, py::object targets,
           float grad_scale, const std::string& logits_dtype, bool accumulate, py::object grad_scale_by,
           py::object ctx) {
            Args args;
            ContextArg c;
            const mf_context* cx = c.get(ctx, args);
            const auto *l = MF_TENSOR(losses), *tdh = MF_OPTIONAL(dh), *tdw = MF_OPTIONAL(dw);
            const auto *th = MF_TENSOR(h), *tw = MF_TENSOR(w), *t = MF_TENSOR(targets);
            const auto* by = MF_OPTIONAL(grad_scale_by);
            const int32_t ld = dtype_from_name(logits_dtype, "logits_dtype");
            call([&] {
                return mf_lm_head_cross_entropy(cx, l, tdh, tdw, th, tw, t, grad_scale, ld, accumulate ? 1 : 0, by);
            });
        },
        "losses"_a, "dh"_a, "dw"_a, "h"_a, "w"_a, "targets"_a, "grad_scale"_a = 0.0f, "logits_dtype"_a = "float32",
        "accumulate"_a = true, "grad_scale_by"_a = py::none(), ctx_arg);
    m.def(
        "lm_head_cross_entropy_workspace_bytes",
        [](int64_t num_rows, int64_t vocab, const std::string& logits_dtype, const std::string& device) {
            const int32_t ld = dtype_from_name(logits_dtype, "logits_dtype");
            size_t bytes = 0;
            call([&] {
                return mf_lm_head_cross_entropy_workspace_bytes(num_rows, vocab, ld,
                                                                device == "cuda" ? MF_CUDA : MF_CPU, &bytes);
            });
            return bytes;
        },
        "num_rows"_a, "vocab"_a, "logits_dtype"_a = "float32", "device"_a = "cpu");
    m.def(
        "moe_aux_stats_workspace_bytes",
        [](int64_t num_rows, int64_t num_experts, const std::string& device) {
            size_t bytes = 0;
            call([&] {
                return mf_moe_aux_stats_workspace_bytes(num_rows, num_experts, device == "cuda" ? MF_CUDA : MF_CPU,
                                                        &bytes);
            });
            return bytes;
        },
        "num_rows"_a, "num_experts"_a, "device"_a = "cpu");
    m.def(
        "moe_permute_indices_workspace_bytes",
        [](int64_t num_rows, int64_t top_k, int64_t num_experts, const std::string& device) {
            size_t bytes = 0;
            call([&] {
                return mf_moe_permute_indices_workspace_bytes(num_rows, top_k, num_experts,
                                                              device == "cuda" ? MF_CUDA : MF_CPU, &bytes);
            });
            return bytes;
        },
        "num_rows"_a, "top_k"_a, "num_experts"_a, "device"_a = "cpu");
    m.def(
        "scale_by",
        [](py::object x, py::object scale, py::object ctx) {
            Args args;
            ContextArg c;
            const mf_context* cx = c.get(ctx, args);
            const auto *tx = MF_TENSOR(x), *ts = MF_TENSOR(scale);
            call([&] { return mf_scale_by(cx, tx, ts); });
        },
        "x"_a, "scale"_a, ctx_arg);
    m.def(
        "adamw_update",
        [](py::object param, py::object master, py::object m_, py::object v, py::object grad, float lr, float beta1,
           float beta2, float eps, float weight_decay, int64_t step, float grad_scale, py::object ctx) {
            Args args;
            ContextArg c;
            const mf_context* cx = c.get(ctx, args);
            const auto *p = args.get(param, "param"), *pm = args.opt(master, "master"), *tm = args.get(m_, "m");
            const auto *tv = args.get(v, "v"), *g = args.get(grad, "grad");
            const mf_adamw_hyper hyper{lr, beta1, beta2, eps, weight_decay, step, grad_scale};
            call([&] { return mf_adamw_update(cx, p, pm, tm, tv, g, &hyper); });
        },
        "param"_a, "master"_a, "m"_a, "v"_a, "grad"_a, "lr"_a, "beta1"_a = 0.9f, "beta2"_a = 0.999f, "eps"_a = 1e-8f,
        "weight_decay"_a = 0.01f, "step"_a, "grad_scale"_a = 1.0f, ctx_arg);
}

mf_moe_dims moe_dims_of(const py::dict& d) {
    mf_moe_dims m{};
    m.hidden = d["hidden"].cast<int64_t>();
    m.intermediate = d["intermediate"].cast<int64_t>();
    m.num_experts = d["num_experts"].cast<int64_t>();
    m.top_k = d["top_k"].cast<int64_t>();
    m.norm_topk_prob = d.contains("norm_topk_prob") && d["norm_topk_prob"].cast<bool>() ? 1 : 0;
    const std::string act = d.contains("activation") ? d["activation"].cast<std::string>() : "swiglu";
    if (act != "swiglu" && act != "relu2") refuse("moe dims: activation '" + act + "' (expected swiglu or relu2)");
    m.activation = act == "relu2" ? MF_ACT_RELU2 : MF_ACT_SWIGLU;
    const std::string router = d.contains("router") ? d["router"].cast<std::string>() : "softmax";
    if (router != "softmax" && router != "sigmoid")
        refuse("moe dims: router '" + router + "' (expected softmax or sigmoid)");
    m.router = router == "sigmoid" ? MF_ROUTER_SIGMOID : MF_ROUTER_SOFTMAX;
    m.n_group = d.contains("n_group") ? d["n_group"].cast<int64_t>() : 1;
    m.topk_group = d.contains("topk_group") ? d["topk_group"].cast<int64_t>() : 1;
    m.routed_scaling_factor = d.contains("routed_scaling_factor") ? d["routed_scaling_factor"].cast<float>() : 1.0f;
    m.masked_score = d.contains("masked_score") ? d["masked_score"].cast<float>() : -INFINITY;
    return m;
}

void bind_moe_block(py::module_& m) {
    m.def(
        "moe_block_workspace_bytes",
        [](const py::dict& dims, int64_t num_tokens, const std::string& device) {
            const mf_moe_dims d = moe_dims_of(dims);
            size_t bytes = 0;
            call([&] {
                return mf_moe_block_workspace_bytes(&d, num_tokens, device == "cuda" ? MF_CUDA : MF_CPU, &bytes);
            });
            return bytes;
        },
        "dims"_a, "num_tokens"_a, "device"_a = "cpu");
    m.def(
        "moe_block_activation_bytes",
        [](const py::dict& dims, int64_t num_tokens, const std::string& device) {
            const mf_moe_dims d = moe_dims_of(dims);
            size_t bytes = 0;
            call([&] {
                return mf_moe_block_activation_bytes(&d, num_tokens, device == "cuda" ? MF_CUDA : MF_CPU, &bytes);
            });
            return bytes;
        },
        "dims"_a, "num_tokens"_a, "device"_a = "cpu");
    m.def(
        "moe_block_forward",
        [](const py::dict& dims, py::object y, py::object x, py::object router, py::object gate_up, py::object down,
           py::object correction_bias, py::object workspace, py::object ctx) {
            const mf_moe_dims d = moe_dims_of(dims);
            Args args;
            ContextArg c;
            const mf_context* cx = c.get(ctx, args);
            const auto *ty = MF_TENSOR(y), *tx = MF_TENSOR(x), *tr = MF_TENSOR(router), *tgu = MF_TENSOR(gate_up);
            const auto *tdn = MF_TENSOR(down), *tb = MF_OPTIONAL(correction_bias), *ws = MF_TENSOR(workspace);
            call([&] { return mf_moe_block_forward(cx, &d, ty, tx, tr, tgu, tdn, tb, ws); });
        },
        "dims"_a, "y"_a, "x"_a, "router"_a, "gate_up"_a, "down"_a, "correction_bias"_a = py::none(), "workspace"_a,
        "ctx"_a = py::none());
    m.def(
        "moe_block_backward",
        [](const py::dict& dims, py::object dx, py::object drouter, py::object dgate_up, py::object ddown,
           py::object dy, py::object dprobs, py::object x, py::object router, py::object gate_up, py::object down,
           py::object correction_bias, py::object workspace, py::object scratch, bool accumulate_expert_grads,
           py::object ctx) {
            const mf_moe_dims d = moe_dims_of(dims);
            Args args;
            ContextArg c;
            const mf_context* cx = c.get(ctx, args);
            const auto *tdx = MF_TENSOR(dx), *tdr = MF_TENSOR(drouter), *tdgu = MF_TENSOR(dgate_up);
            const auto *tddn = MF_TENSOR(ddown), *tdy = MF_TENSOR(dy), *tdp = MF_OPTIONAL(dprobs);
            const auto *tx = MF_TENSOR(x), *tr = MF_TENSOR(router), *tgu = MF_TENSOR(gate_up), *tdn = MF_TENSOR(down);
            const auto *tb = MF_OPTIONAL(correction_bias), *ws = MF_TENSOR(workspace), *sc = MF_OPTIONAL(scratch);
            call([&] {
                return mf_moe_block_backward(cx, &d, tdx, tdr, tdgu, tddn, tdy, tdp, tx, tr, tgu, tdn, tb, ws, sc,
                                             accumulate_expert_grads ? 1 : 0);
            });
        },
        "dims"_a, "dx"_a, "drouter"_a, "dgate_up"_a, "ddown"_a, "dy"_a, "dprobs"_a = py::none(), "x"_a, "router"_a,
        "gate_up"_a, "down"_a, "correction_bias"_a = py::none(), "workspace"_a, "scratch"_a = py::none(),
        "accumulate_expert_grads"_a = true, "ctx"_a = py::none());
}

}  // namespace

PYBIND11_MODULE(_native, m) {
    m.doc() = "moeforge's C API (include/moeforge/moeforge.h) for Python; use the moeforge package";
    m.attr("API_VERSION") = MF_API_VERSION;
    m.def("api_version", &mf_api_version);
    m.def("has_cuda", [] { return mf_has_cuda() != 0; });
    m.def("built_with_cuda", [] { return mf_built_with_cuda() != 0; });
    m.def(
        "set_error_classes",
        [](py::object invalid, py::object unsupported, py::object cuda, py::object io, py::object internal) {
            g_error_classes[MF_ERR_INVALID_ARGUMENT] = invalid;
            g_error_classes[MF_ERR_UNSUPPORTED] = unsupported;
            g_error_classes[MF_ERR_CUDA] = cuda;
            g_error_classes[MF_ERR_IO] = io;
            g_error_classes[MF_ERR_INTERNAL] = internal;
        },
        "invalid_argument"_a, "unsupported"_a, "cuda"_a, "io"_a, "internal"_a);
    m.def(
        "synchronize",
        [](py::object ctx) {
            Args args;
            ContextArg c;
            const mf_context* cx = c.get(ctx, args);
            call([&] { return mf_synchronize(cx, MF_CUDA); });
        },
        "ctx"_a = py::none());

    m.def(
        "register_array_type",
        [](py::object cls, const py::dict& dtypes) {
            ArrayType type{cls, {}};
            for (const auto& [object, dtype_name] : dtypes)
                type.dtypes.emplace_back(py::reinterpret_borrow<py::object>(object),
                                         dtype_from_name(dtype_name.cast<std::string>(), "register_array_type"));
            for (ArrayType& t : g_array_types)
                if (t.cls.is(cls)) return void(t = std::move(type));
            g_array_types.push_back(std::move(type));
        },
        "cls"_a, "dtypes"_a,
        "Read arrays of type `cls` through their own methods rather than DLPack: data_ptr(), dtype (a key of "
        "`dtypes`, which maps the type's dtype objects to moeforge's names), shape, stride(), is_cuda / is_cpu "
        "and get_device(). moeforge.hf registers torch.Tensor.");
    py::class_<RawTensor>(m, "RawTensor", "A tensor given by a raw data pointer (contiguous, row-major)")
        .def(py::init([](uintptr_t data, std::string dtype, std::vector<int64_t> shape, std::string device,
                         int device_index) {
                 return RawTensor{data, std::move(dtype), std::move(shape), std::move(device), device_index};
             }),
             "data"_a, "dtype"_a, "shape"_a, "device"_a = "cpu", "device_index"_a = 0)
        .def_readonly("data", &RawTensor::data)
        .def_readonly("dtype", &RawTensor::dtype)
        .def_readonly("shape", &RawTensor::shape)
        .def_readonly("device", &RawTensor::device);
    py::class_<Context>(m, "Context", "Where an op runs: a CUDA device, a stream (an integer) and a workspace")
        .def(py::init([](int device, uint64_t stream, py::object workspace) {
                 return Context{device, stream, std::move(workspace)};
             }),
             "device"_a = -1, "stream"_a = 0, "workspace"_a = py::none())
        .def_readonly("device", &Context::device)
        .def_readonly("stream", &Context::stream);
    py::class_<View>(m, "TensorView", py::buffer_protocol(),
                     "A zero-copy view of an engine tensor: DLPack (numpy.from_dlpack, torch.from_dlpack) and, "
                     "on the CPU, the buffer protocol (numpy.asarray: writable)")
        .def_buffer(&View::buffer)
        .def("__dlpack__", &View::dlpack, "stream"_a = py::none())
        .def("__dlpack_device__", &View::dlpack_device)
        .def_property_readonly("shape",
                               [](const View& v) { return std::vector<int64_t>(v.t.shape, v.t.shape + v.t.ndim); })
        .def_property_readonly("dtype", [](const View& v) {
            static const char* names[] = {"float32", "bfloat16", "int32", "int64", "float64"};
            return std::string(v.t.dtype >= 0 && v.t.dtype <= 4 ? names[v.t.dtype] : "unknown");
        });

    py::class_<Engine>(m, "Engine", "The fine-tuning engine (mf_engine_*); use moeforge.Engine")
        .def(py::init<const std::string&, bool, const std::string&, const std::vector<std::string>&, const std::string&,
                      bool>(),
             "recipe"_a, "is_text"_a, "base_dir"_a, "overrides"_a, "resume"_a, "force_resume"_a)
        .def("step", &Engine::step)
        .def("progress", &Engine::progress)
        .def("save_checkpoint", &Engine::save_checkpoint)
        .def("export", &Engine::export_model)
        .def("recipe_json", &Engine::recipe_json)
        .def("param_names", &Engine::param_names)
        .def(
            "param",
            [](py::object self, const std::string& name, bool gradient) {
                return std::make_unique<View>(self.cast<Engine&>().param(name, gradient), self);
            },
            "name"_a, "gradient"_a = false)
        .def("close", &Engine::close);

    py::class_<Weights>(m, "Weights", "A Hugging Face model directory's weights (mf_weights_*); use moeforge.Weights")
        .def(py::init<const std::string&>(), "model_dir"_a)
        .def("names", &Weights::names)
        .def("info", &Weights::info, "name"_a)
        .def("read_f32", &Weights::read_f32, "name"_a, "out"_a)
        .def("close", &Weights::close);

    bind_ops(m);
    bind_moe_block(m);
}
