// jequi's one XLA FFI handler: launches a generated CUDA kernel by name.
//
// Every kernel of the CUDA JIT backend goes through this handler, so it is compiled once per
// machine (host code only, no CUDA toolkit needed) and each kernel only as a cubin. Python
// (ffi/build.py) registers each cubin under its content hash with jequi_register_kernel; a
// call names the kernel in its "kernel" attribute and the handler loads the module into the
// stream's context on first use (module loads need the context that XLA makes current when it
// runs the handler, so they cannot happen at registration time).
//
// Kernel parameters: a pointer per argument buffer, then a pointer per result buffer, then the
// int64 attribute array "scalars". Result i is zeroed before the launch where bit i of the
// attribute "zero" is set (a kernel that adds into it with atomics, or leaves parts of it
// unwritten: ffi.ops.untouched). Launch: block "threads"
// x 1 x 1, "smem" bytes of dynamic shared memory, grid ("grid_x", B, 1) where
// B = element_count(argument 0) / "unit": the batch size, which grows when jax.vmap batches
// the call (vmap_method="broadcast_all").
//
// The CUDA driver API is opened with dlopen, so building this file needs only a C++17
// compiler and jaxlib's FFI headers.

#include <dlfcn.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using CUresult = int;
using CUcontext = void*;
using CUmodule = void*;
using CUfunction = void*;
using CUstream = struct CUstream_st*;
using cudaStream_t = CUstream;
constexpr int kMaxDynamicSharedBytes = 8;  // CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES

struct Driver {
  CUresult (*ctx_push)(CUcontext);
  CUresult (*ctx_pop)(CUcontext*);
  CUresult (*stream_ctx)(CUstream, CUcontext*);
  CUresult (*module_load)(CUmodule*, const void*);
  CUresult (*get_function)(CUfunction*, CUmodule, const char*);
  CUresult (*set_attribute)(CUfunction, int, int);
  CUresult (*launch)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                     CUstream, void**, void**);
  CUresult (*error_string)(CUresult, const char**);
  CUresult (*memset_async)(unsigned long long, unsigned char, size_t, CUstream);
  std::string error;
};

template <typename F>
bool Load(void* lib, const char* name, F* fn, std::string* error) {
  *fn = reinterpret_cast<F>(dlsym(lib, name));
  if (*fn == nullptr && error->empty()) *error = std::string("libcuda has no ") + name;
  return *fn != nullptr;
}

const Driver& GetDriver() {
  static const Driver driver = [] {
    Driver d{};
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
      d.error = "cannot open libcuda.so.1";
      return d;
    }
    Load(lib, "cuCtxPushCurrent_v2", &d.ctx_push, &d.error);
    Load(lib, "cuCtxPopCurrent_v2", &d.ctx_pop, &d.error);
    Load(lib, "cuStreamGetCtx", &d.stream_ctx, &d.error);
    Load(lib, "cuModuleLoadData", &d.module_load, &d.error);
    Load(lib, "cuModuleGetFunction", &d.get_function, &d.error);
    Load(lib, "cuFuncSetAttribute", &d.set_attribute, &d.error);
    Load(lib, "cuLaunchKernel", &d.launch, &d.error);
    Load(lib, "cuGetErrorString", &d.error_string, &d.error);
    Load(lib, "cuMemsetD8Async", &d.memset_async, &d.error);
    return d;
  }();
  return driver;
}

struct Kernel {
  std::string image;  // the cubin
  std::string entry;  // its kernel's name
  std::map<CUcontext, CUfunction> loaded;
};

std::mutex registry_mutex;
std::map<std::string, std::unique_ptr<Kernel>>& Registry() {
  static auto* registry = new std::map<std::string, std::unique_ptr<Kernel>>();
  return *registry;
}

ffi::Error DriverError(const Driver& d, CUresult status, const char* what) {
  const char* text = nullptr;
  if (d.error_string != nullptr) d.error_string(status, &text);
  return ffi::Error::Internal(std::string("jequi: ") + what + " failed: " + (text ? text : "unknown CUDA error"));
}

// The kernel's function in the stream's context, loading its module there on first use.
ffi::ErrorOr<CUfunction> Function(const Driver& d, Kernel* kernel, CUstream stream, int64_t smem) {
  CUcontext ctx = nullptr;
  CUresult status = d.stream_ctx(stream, &ctx);
  if (status != 0) return ffi::Unexpected(DriverError(d, status, "cuStreamGetCtx"));
  std::lock_guard<std::mutex> lock(registry_mutex);
  auto found = kernel->loaded.find(ctx);
  if (found != kernel->loaded.end()) return found->second;
  if ((status = d.ctx_push(ctx)) != 0) return ffi::Unexpected(DriverError(d, status, "cuCtxPushCurrent"));
  CUmodule module = nullptr;
  CUfunction fn = nullptr;
  status = d.module_load(&module, kernel->image.data());
  if (status == 0) status = d.get_function(&fn, module, kernel->entry.c_str());
  if (status == 0 && smem > 48 * 1024) status = d.set_attribute(fn, kMaxDynamicSharedBytes, static_cast<int>(smem));
  CUcontext popped = nullptr;
  d.ctx_pop(&popped);
  if (status != 0) return ffi::Unexpected(DriverError(d, status, "loading the kernel module"));
  kernel->loaded.emplace(ctx, fn);
  return fn;
}

ffi::Error Launch(cudaStream_t stream, ffi::RemainingArgs args, ffi::RemainingRets rets, std::string_view name,
                  int64_t grid_x, int64_t unit, int64_t threads, int64_t smem, int64_t zero,
                  ffi::Span<const int64_t> scalars) {
  const Driver& d = GetDriver();
  if (!d.error.empty()) return ffi::Error::Internal("jequi: " + d.error);
  Kernel* kernel = nullptr;
  {
    std::lock_guard<std::mutex> lock(registry_mutex);
    auto found = Registry().find(std::string(name));
    if (found == Registry().end())
      return ffi::Error::Internal("jequi: kernel " + std::string(name) + " is not registered in this process");
    kernel = found->second.get();
  }
  if (args.size() == 0 || unit <= 0) return ffi::Error::InvalidArgument("jequi: a kernel needs argument 0 and a unit");
  std::vector<void*> pointers;
  for (size_t i = 0; i < args.size(); ++i) {
    auto buffer = args.get<ffi::AnyBuffer>(i);
    if (!buffer) return buffer.error();
    pointers.push_back(buffer->untyped_data());
  }
  auto first = args.get<ffi::AnyBuffer>(0);
  const int64_t batch = static_cast<int64_t>(first->element_count()) / unit;
  for (size_t i = 0; i < rets.size(); ++i) {
    auto buffer = rets.get<ffi::AnyBuffer>(i);
    if (!buffer) return buffer.error();
    pointers.push_back((*buffer)->untyped_data());
    if ((zero >> i) & 1) {
      CUresult status = d.memset_async(reinterpret_cast<unsigned long long>((*buffer)->untyped_data()), 0,
                                       (*buffer)->size_bytes(), stream);
      if (status != 0) return DriverError(d, status, "cuMemsetD8Async");
    }
  }
  if (batch == 0 || grid_x == 0) return ffi::Error::Success();
  std::vector<int64_t> values(scalars.begin(), scalars.end());
  std::vector<void*> params;
  for (void*& p : pointers) params.push_back(&p);
  for (int64_t& v : values) params.push_back(&v);
  auto fn = Function(d, kernel, stream, smem);
  if (!fn) return fn.error();
  CUresult status = d.launch(*fn, static_cast<unsigned>(grid_x), static_cast<unsigned>(batch), 1,
                             static_cast<unsigned>(threads), 1, 1, static_cast<unsigned>(smem), stream,
                             params.data(), nullptr);
  if (status != 0) return DriverError(d, status, "cuLaunchKernel");
  return ffi::Error::Success();
}

}  // namespace

// Registers a cubin under `name` (idempotent). Returns 0.
extern "C" int jequi_register_kernel(const char* name, const char* image, int64_t size, const char* entry) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  auto& slot = Registry()[name];
  if (!slot) slot.reset(new Kernel{std::string(image, static_cast<size_t>(size)), entry, {}});
  return 0;
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JequiLaunch, Launch,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<std::string_view>("kernel")
                                  .Attr<int64_t>("grid_x")
                                  .Attr<int64_t>("unit")
                                  .Attr<int64_t>("threads")
                                  .Attr<int64_t>("smem")
                                  .Attr<int64_t>("zero")
                                  .Attr<ffi::Span<const int64_t>>("scalars"));
