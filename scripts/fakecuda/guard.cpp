// The CUDA plumbing a CPU-only libtorch lacks, as no-ops, so that FakeTensors on device
// "cuda" get through the C++ paths that ask for it: a device guard (Tensor.to, copy_,
// autograd's input metadata) and the accelerator hooks (autograd asks them for the current
// stream; without them the first op that records a gradient terminates the process).
// Loaded with RTLD_GLOBAL before `import torch` (harness.py). Nothing here allocates or runs
// a kernel: only FakeTensors, which compute nothing, may carry device cuda.
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

namespace {
using namespace c10;

DeviceIndex index_of(Device d) { return d.index() < 0 ? 0 : d.index(); }

struct NoOpCudaGuard final : public impl::DeviceGuardImplInterface {
  static thread_local DeviceIndex current;
  static thread_local StreamId stream;
  DeviceType type() const override { return DeviceType::CUDA; }
  Device exchangeDevice(Device d) const override {
    Device old(DeviceType::CUDA, current);
    current = index_of(d);
    return old;
  }
  Device getDevice() const override { return Device(DeviceType::CUDA, current); }
  void setDevice(Device d) const override { current = index_of(d); }
  void uncheckedSetDevice(Device d) const noexcept override { current = index_of(d); }
  Stream getStream(Device d) const override {
    return Stream(Stream::UNSAFE, Device(DeviceType::CUDA, index_of(d)), stream);
  }
  Stream getDefaultStream(Device d) const override {
    return Stream(Stream::DEFAULT, Device(DeviceType::CUDA, index_of(d)));
  }
  Stream exchangeStream(Stream s) const override {
    const StreamId old = stream;
    stream = s.id();
    return Stream(Stream::UNSAFE, s.device(), old);
  }
  DeviceIndex deviceCount() const noexcept override { return 1; }
  void record(void**, const Stream&, const DeviceIndex, const EventFlag) const override {}
  void block(void*, const Stream&) const override {}
  bool queryEvent(void*) const override { return true; }
  void destroyEvent(void*, const DeviceIndex) const noexcept override {}
  void synchronizeDevice(const DeviceIndex) const override {}
};
thread_local DeviceIndex NoOpCudaGuard::current = 0;
thread_local StreamId NoOpCudaGuard::stream = 0;
C10_REGISTER_GUARD_IMPL(CUDA, NoOpCudaGuard);
}  // namespace

// "Built" but not "available": at::accelerator then names CUDA (autograd's stream queries),
// while hasCUDA() stays false, so nothing starts a CUDA runtime there is none of. The class
// must be called CUDAHooks: the registry looks hooks up by that name.
namespace at::fbtrain_fake_cuda {
struct CUDAHooks final : at::CUDAHooksInterface {
  CUDAHooks(at::CUDAHooksArgs) {}
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return false; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return false; }
  c10::DeviceIndex deviceCount() const override { return 1; }
  c10::DeviceIndex getCurrentDevice() const override { return 0; }
  void setCurrentDevice(c10::DeviceIndex) const override {}
  c10::DeviceIndex exchangeDevice(c10::DeviceIndex) const override { return 0; }
  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex) const override { return 0; }
};
REGISTER_CUDA_HOOKS(CUDAHooks);
}  // namespace at::fbtrain_fake_cuda
