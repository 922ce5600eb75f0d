// A kernel timeline for any CUDA program, kernels inside CUDA graphs included:
// a CUPTI injection library (the device machine has no Nsight Systems).
//
//   CUDA_INJECTION64_PATH=build/libdspark_kernel_trace.so DSPARK_KERNEL_TRACE=trace.csv  dspark bench spec ...
//
// The driver loads it at cuInit and calls InitializeInjection(). It records
// every kernel (with its graph node, so a replayed graph's kernels appear one
// by one), every memory copy, and the runtime calls that wait or launch
// (synchronisations, graph launches, copies), and writes them at exit as CSV:
//   kind,name,start_ns,end_ns,stream,correlation
// kind is kernel (its name ends with its grid, [x y z]), memcpy or api; times are CUPTI's (one clock for host and
// device records). bench/trace_rounds.py turns it into a speculative round's
// phases. Recording costs about a microsecond a record on the host; the GPU's
// timings are the hardware's.
#include <cupti.h>
#include <cxxabi.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

namespace {

constexpr size_t kBufferBytes = 8 << 20;

std::mutex output_mutex;
FILE* output = nullptr;

void check(CUptiResult result, const char* what) {
  if (result == CUPTI_SUCCESS) return;
  const char* message = nullptr;
  cuptiGetResultString(result, &message);
  std::fprintf(stderr, "kernel trace: %s failed: %s\n", what, message ? message : "?");
  std::exit(1);
}

// Names demangled, without commas or quotes (template arguments have commas).
std::string field(const char* name) {
  int status = 1;
  char* demangled = name ? abi::__cxa_demangle(name, nullptr, nullptr, &status) : nullptr;
  std::string text = status == 0 ? demangled : name ? name : "?";
  std::free(demangled);
  for (char& c : text)
    if (c == ',' || c == '"' || c == '\n') c = ';';
  return text;
}

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, kBufferBytes));
  *size = kBufferBytes;
  *max_records = 0;
}

void CUPTIAPI buffer_completed(CUcontext context, uint32_t stream, uint8_t* buffer, size_t, size_t valid_bytes) {
  std::lock_guard lock(output_mutex);
  size_t dropped = 0;
  if (cuptiActivityGetNumDroppedRecords(context, stream, &dropped) == CUPTI_SUCCESS && dropped > 0)
    std::fprintf(stderr, "kernel trace: %zu records dropped (the trace has gaps)\n", dropped);
  CUpti_Activity* record = nullptr;
  while (cuptiActivityGetNextRecord(buffer, valid_bytes, &record) == CUPTI_SUCCESS) {
    if (record->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL || record->kind == CUPTI_ACTIVITY_KIND_KERNEL) {
      const auto* kernel = reinterpret_cast<const CUpti_ActivityKernel10*>(record);
      std::fprintf(output, "kernel,%s [%d %d %d],%llu,%llu,%u,%u\n", field(kernel->name).c_str(), kernel->gridX,
                   kernel->gridY, kernel->gridZ, static_cast<unsigned long long>(kernel->start),
                   static_cast<unsigned long long>(kernel->end), kernel->streamId, kernel->correlationId);
    } else if (record->kind == CUPTI_ACTIVITY_KIND_MEMCPY) {
      const auto* copy = reinterpret_cast<const CUpti_ActivityMemcpy6*>(record);
      std::fprintf(output, "memcpy,%s %llu bytes,%llu,%llu,%u,%u\n",
                   copy->copyKind == CUPTI_ACTIVITY_MEMCPY_KIND_DTOH   ? "device to host"
                   : copy->copyKind == CUPTI_ACTIVITY_MEMCPY_KIND_HTOD ? "host to device"
                                                                       : "other",
                   static_cast<unsigned long long>(copy->bytes), static_cast<unsigned long long>(copy->start),
                   static_cast<unsigned long long>(copy->end), copy->streamId, copy->correlationId);
    } else if (record->kind == CUPTI_ACTIVITY_KIND_RUNTIME) {
      const auto* call = reinterpret_cast<const CUpti_ActivityAPI*>(record);
      const char* name = nullptr;
      cuptiGetCallbackName(CUPTI_CB_DOMAIN_RUNTIME_API, call->cbid, &name);
      std::fprintf(output, "api,%s,%llu,%llu,0,%u\n", field(name).c_str(), static_cast<unsigned long long>(call->start),
                   static_cast<unsigned long long>(call->end), call->correlationId);
    }
  }
  std::free(buffer);
}

void finish() {
  cuptiActivityFlushAll(1);
  std::lock_guard lock(output_mutex);
  if (output) std::fclose(output), output = nullptr;
}

}  // namespace

extern "C" int InitializeInjection() {
  const char* path = std::getenv("DSPARK_KERNEL_TRACE");
  output = std::fopen(path ? path : "kernel_trace.csv", "w");
  if (!output) {
    std::fprintf(stderr, "kernel trace: cannot write %s\n", path ? path : "kernel_trace.csv");
    return 0;
  }
  std::fprintf(output, "kind,name,start_ns,end_ns,stream,correlation\n");
  check(cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed), "cuptiActivityRegisterCallbacks");
  check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL), "enabling kernel records");
  check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY), "enabling copy records");
  check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_RUNTIME), "enabling runtime records");
  std::atexit(finish);
  return 1;
}
