// What a CPU-only torch lacks before FakeTensorMode can run autograd on tensors of device "cuda".
// harness.py (beside this file) builds it with g++ against the installed torch and loads it
// (RTLD_GLOBAL) before the first `import torch`: torch reads the CUDA hooks registry when it is
// imported.
//  * The device guard slot for CUDA is empty in a CPU build; the autograd engine asks that guard
//    for the current stream of every cuda tensor it sees. c10's own FakeGuardImpl answers (a
//    no-op guard).
//  * at::getAccelerator() asks the CUDA hooks whether CUDA is there; with hasCUDA() true it names
//    "cuda", which the autograd engine needs to accumulate gradients of cuda tensors.
//  * torch.Generator(device="cuda") asks the hooks for a generator: a CPU one that says it is on
//    cuda:0 (fake tensors draw no numbers; the project seeds and passes such generators).
// torch.cuda.is_available() stays False (it asks torch._C._cuda_getDeviceCount, which a CPU build
// lacks); simcuda.SimulatedCUDA answers for it. Nothing here runs a kernel or allocates memory.
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/FakeGuardImpl.h>

namespace simcuda {

struct SimulatedCUDAGenerator : at::CPUGeneratorImpl {
  explicit SimulatedCUDAGenerator(uint64_t seed = c10::default_rng_seed_val)
      : at::CPUGeneratorImpl(seed) {
    device_ = c10::Device(c10::DeviceType::CUDA, 0);
  }
  SimulatedCUDAGenerator* clone_impl() const override {
    auto copy = new SimulatedCUDAGenerator();
    copy->set_current_seed(current_seed());
    return copy;
  }
};

struct SimulatedCUDAHooks : at::CUDAHooksInterface {
  explicit SimulatedCUDAHooks(at::CUDAHooksArgs) {}
  void init() const override {}
  bool isBuilt() const override { return true; }
  bool hasCUDA() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  c10::DeviceIndex deviceCount() const override { return 1; }
  int getNumGPUs() const override { return 1; }
  c10::DeviceIndex getCurrentDevice() const override { return 0; }
  c10::DeviceIndex current_device() const override { return 0; }
  void setCurrentDevice(c10::DeviceIndex) const override {}
  c10::DeviceIndex exchangeDevice(c10::DeviceIndex) const override { return 0; }
  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex) const override { return 0; }
  void deviceSynchronize(c10::DeviceIndex) const override {}
  const at::Generator& getDefaultGenerator(c10::DeviceIndex) const override {
    static at::Generator generator = at::make_generator<SimulatedCUDAGenerator>();
    return generator;
  }
  at::Generator getNewGenerator(c10::DeviceIndex) const override {
    return at::make_generator<SimulatedCUDAGenerator>();
  }
};

c10::impl::FakeGuardImpl<c10::DeviceType::CUDA> guard;

// runs when the library is loaded
struct RegisterGuard {
  RegisterGuard() {
    auto& slot = c10::impl::device_guard_impl_registry[static_cast<size_t>(c10::DeviceType::CUDA)];
    if (slot.load() == nullptr) {  // a CUDA build has its own guard: leave it
      slot.store(&guard);
    }
  }
} register_guard;

}  // namespace simcuda

namespace at {
C10_REGISTER_CLASS(CUDAHooksRegistry, CUDAHooks, ::simcuda::SimulatedCUDAHooks);
}

// lets the harness check that this library, not a real CUDA runtime, is what it loaded
extern "C" int simcuda_loaded() { return 1; }
