#include "model/target.h"

#include "core/error.h"
#include "model/cpu_target.h"
#ifdef DSPARK_CUDA
#include "kernels/cuda/device.h"
#include "model/cuda_target.h"
#endif

namespace dspark {

std::string default_device() {
#ifdef DSPARK_CUDA
  if (cuda::device_count() > 0) return "cuda";
#endif
  return "cpu";
}

std::string resolve_device(const std::string& device) { return device == "auto" ? default_device() : device; }

std::unique_ptr<Target> load_target(const std::filesystem::path& model_directory,
                                    const std::string& device) {
  const std::string resolved = resolve_device(device);
  if (resolved == "cpu") return std::make_unique<CpuTarget>(load_transformer(model_directory));
  if (resolved == "cuda") {
#ifdef DSPARK_CUDA
    DSPARK_CHECK(cuda::device_count() > 0, "--device cuda: no CUDA GPU is visible");
    return make_cuda_target(model_directory);
#else
    fail("--device cuda: this build has no CUDA support (nvcc was not found at build time)");
#endif
  }
  fail("unknown device \"", device, "\" (cpu, cuda or auto)");
}

}  // namespace dspark
