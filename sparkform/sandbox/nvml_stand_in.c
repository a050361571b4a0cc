/*
 * sparkform sandbox: a stand-in for libnvidia-ml.so.1 (NVML). The sandbox has no GPU, yet
 * `sparkform status` reads the GPU with pynvml, which loads libnvidia-ml.so.1; this answers the
 * calls pynvml makes for that report the way a DGX Spark's GB10 answers them: one GPU, its
 * readings, and NVML_ERROR_NOT_SUPPORTED for memory (unified memory: the real GB10 says so too,
 * and nvidia-smi prints "Not Supported").
 *
 * Values: the env file the stand-in nvidia-smi reads ($SPARKFORM_NVIDIA_ENV, default
 * /etc/sparkform-sandbox/nvidia.env; KEY=VALUE lines, shell-quoted as
 * sparkform.sandbox.stage.nvidia_env_text writes them), read at each nvmlInit, so a driver that
 * stage.set_driver rehearses shows in both stand-ins. Keys: DRIVER_VERSION, CUDA_VERSION,
 * GPU_NAME, GPU_UTILIZATION_PERCENT, GPU_TEMPERATURE_C, GPU_POWER_MW, SM_CLOCK_MHZ,
 * GRAPHICS_CLOCK_MHZ, CLOCKS_EVENT_REASONS (the bitmask, decimal or 0x hex).
 *
 * Return codes (NVML's): nvmlInit gives NVML_ERROR_DRIVER_NOT_LOADED when the env file is
 * missing (nvidia-smi's exit 9) and NVML_ERROR_UNKNOWN when a value is missing or malformed;
 * any other call before nvmlInit gives NVML_ERROR_UNINITIALIZED.
 *
 * Built in the sandbox by sparkform.sandbox.stage (NVML_BUILD_FLAGS); only the functions below
 * exist, so pynvml answers NVML_ERROR_FUNCTION_NOT_FOUND for any other.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define EXPORT __attribute__((visibility("default")))

typedef int nvmlReturn_t;
enum {
  NVML_SUCCESS = 0,
  NVML_ERROR_UNINITIALIZED = 1,
  NVML_ERROR_INVALID_ARGUMENT = 2,
  NVML_ERROR_NOT_SUPPORTED = 3,
  NVML_ERROR_INSUFFICIENT_SIZE = 7,
  NVML_ERROR_DRIVER_NOT_LOADED = 9,
  NVML_ERROR_UNKNOWN = 999,
};
enum { NVML_CLOCK_GRAPHICS = 0, NVML_CLOCK_SM = 1 };
enum { NVML_TEMPERATURE_GPU = 0 };

typedef struct nvmlDevice_st *nvmlDevice_t;
typedef struct {
  unsigned int gpu;
  unsigned int memory;
} nvmlUtilization_t;

#define ENV_DEFAULT "/etc/sparkform-sandbox/nvidia.env"
#define TEXT_MAX 96 /* NVML_DEVICE_NAME_V2_BUFFER_SIZE, the longest text NVML hands out */

/* The one GPU: its handle is the address of this struct. */
struct nvmlDevice_st {
  char driver[TEXT_MAX];
  char name[TEXT_MAX];
  int cuda_version; /* 13.0 -> 13000, as nvmlSystemGetCudaDriverVersion gives it */
  unsigned int utilization, temperature, power_mw, sm_clock, graphics_clock;
  unsigned long long event_reasons;
};
static struct nvmlDevice_st gb10;
static unsigned int init_count; /* NVML counts nvmlInit calls; the last nvmlShutdown ends it */

/* One shell word as shlex.quote writes it ('...' and "'" segments, backslashes, bare text) into
 * out; 0 when it ends unquoted within `size` bytes. */
static int unquote(const char *in, char *out, size_t size) {
  size_t n = 0;
  char quote = 0;
  for (; *in && *in != '\n'; in++) {
    char c = *in;
    if (quote && c == quote) {
      quote = 0;
      continue;
    }
    if (!quote && (c == '\'' || c == '"')) {
      quote = c;
      continue;
    }
    if (!quote && (c == ' ' || c == '\t')) break;
    if (quote != '\'' && c == '\\' && in[1] && in[1] != '\n') c = *++in;
    if (n + 1 >= size) return 0;
    out[n++] = c;
  }
  out[n] = '\0';
  return !quote;
}

/* The value of `key` in the env file text (the last line that sets it), or 0. */
static int env_value(const char *text, const char *key, char *out, size_t size) {
  size_t key_len = strlen(key);
  int found = 0;
  const char *line = text;
  while (line) {
    while (*line == ' ' || *line == '\t') line++;
    if (strncmp(line, key, key_len) == 0 && line[key_len] == '=') found = unquote(line + key_len + 1, out, size);
    const char *end = strchr(line, '\n');
    line = end ? end + 1 : NULL;
  }
  return found;
}

static int env_number(const char *text, const char *key, int base, unsigned long long max, unsigned long long *out) {
  char value[TEXT_MAX], *end;
  if (!env_value(text, key, value, sizeof value) || !value[0] || value[0] == '-') return 0;
  *out = strtoull(value, &end, base);
  return *end == '\0' && *out <= max;
}

static int env_unsigned(const char *text, const char *key, unsigned int max, unsigned int *out) {
  unsigned long long value;
  if (!env_number(text, key, 10, max, &value)) return 0;
  *out = (unsigned int)value;
  return 1;
}

/* CUDA_VERSION "13.0" -> 13000. */
static int env_cuda(const char *text, int *out) {
  char value[TEXT_MAX];
  int major, minor, used = 0;
  if (!env_value(text, "CUDA_VERSION", value, sizeof value)) return 0;
  if (sscanf(value, "%3d.%2d%n", &major, &minor, &used) != 2 || value[used] || major < 0 || minor < 0) return 0;
  *out = major * 1000 + minor * 10;
  return 1;
}

static nvmlReturn_t read_env(void) {
  const char *path = getenv("SPARKFORM_NVIDIA_ENV");
  FILE *file = fopen(path && *path ? path : ENV_DEFAULT, "r");
  if (!file) return NVML_ERROR_DRIVER_NOT_LOADED;
  char text[8192];
  size_t length = fread(text, 1, sizeof text - 1, file);
  int whole = feof(file) && !ferror(file);
  fclose(file);
  if (!whole) return NVML_ERROR_UNKNOWN;
  text[length] = '\0';
  struct nvmlDevice_st gpu;
  int ok = env_value(text, "DRIVER_VERSION", gpu.driver, sizeof gpu.driver) && gpu.driver[0] &&
           env_value(text, "GPU_NAME", gpu.name, sizeof gpu.name) && gpu.name[0] && env_cuda(text, &gpu.cuda_version) &&
           env_unsigned(text, "GPU_UTILIZATION_PERCENT", 100, &gpu.utilization) &&
           env_unsigned(text, "GPU_TEMPERATURE_C", 200, &gpu.temperature) &&
           env_unsigned(text, "GPU_POWER_MW", 2000000, &gpu.power_mw) &&
           env_unsigned(text, "SM_CLOCK_MHZ", 10000, &gpu.sm_clock) &&
           env_unsigned(text, "GRAPHICS_CLOCK_MHZ", 10000, &gpu.graphics_clock) &&
           env_number(text, "CLOCKS_EVENT_REASONS", 0, ~0ULL, &gpu.event_reasons);
  if (!ok) return NVML_ERROR_UNKNOWN;
  gb10 = gpu;
  return NVML_SUCCESS;
}

static nvmlReturn_t copy_text(const char *text, char *out, unsigned int length) {
  if (!out) return NVML_ERROR_INVALID_ARGUMENT;
  if (strlen(text) + 1 > length) return NVML_ERROR_INSUFFICIENT_SIZE;
  strcpy(out, text);
  return NVML_SUCCESS;
}

/* The checks every device call starts with. */
static nvmlReturn_t device_call(nvmlDevice_t device, const void *out) {
  if (!init_count) return NVML_ERROR_UNINITIALIZED;
  return device == &gb10 && out ? NVML_SUCCESS : NVML_ERROR_INVALID_ARGUMENT;
}

EXPORT nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
  (void)flags;
  nvmlReturn_t result = init_count ? NVML_SUCCESS : read_env();
  if (result == NVML_SUCCESS) init_count++;
  return result;
}

EXPORT nvmlReturn_t nvmlInit_v2(void) { return nvmlInitWithFlags(0); }

EXPORT nvmlReturn_t nvmlShutdown(void) {
  if (!init_count) return NVML_ERROR_UNINITIALIZED;
  init_count--;
  return NVML_SUCCESS;
}

EXPORT const char *nvmlErrorString(nvmlReturn_t result) {
  switch (result) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    default: return "Unknown Error";
  }
}

EXPORT nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length) {
  return init_count ? copy_text(gb10.driver, version, length) : NVML_ERROR_UNINITIALIZED;
}

EXPORT nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *version) {
  if (!init_count) return NVML_ERROR_UNINITIALIZED;
  if (!version) return NVML_ERROR_INVALID_ARGUMENT;
  *version = gb10.cuda_version;
  return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *version) { return nvmlSystemGetCudaDriverVersion(version); }

EXPORT nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count) {
  if (!init_count) return NVML_ERROR_UNINITIALIZED;
  if (!count) return NVML_ERROR_INVALID_ARGUMENT;
  *count = 1;
  return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
  if (!init_count) return NVML_ERROR_UNINITIALIZED;
  if (index != 0 || !device) return NVML_ERROR_INVALID_ARGUMENT;
  *device = &gb10;
  return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length) {
  nvmlReturn_t result = device_call(device, name);
  return result == NVML_SUCCESS ? copy_text(gb10.name, name, length) : result;
}

EXPORT nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t device, nvmlUtilization_t *utilization) {
  nvmlReturn_t result = device_call(device, utilization);
  if (result != NVML_SUCCESS) return result;
  utilization->gpu = gb10.utilization;
  utilization->memory = 0; /* the memory controller's load: not in the capture, and unused */
  return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetClockInfo(nvmlDevice_t device, int type, unsigned int *clock) {
  nvmlReturn_t result = device_call(device, clock);
  if (result != NVML_SUCCESS) return result;
  switch (type) {
    case NVML_CLOCK_GRAPHICS: *clock = gb10.graphics_clock; return NVML_SUCCESS;
    case NVML_CLOCK_SM: *clock = gb10.sm_clock; return NVML_SUCCESS;
    default: return NVML_ERROR_NOT_SUPPORTED; /* GB10 exposes no memory clock */
  }
}

EXPORT nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t device, int sensor, unsigned int *temperature) {
  nvmlReturn_t result = device_call(device, temperature);
  if (result != NVML_SUCCESS) return result;
  if (sensor != NVML_TEMPERATURE_GPU) return NVML_ERROR_INVALID_ARGUMENT;
  *temperature = gb10.temperature;
  return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetPowerUsage(nvmlDevice_t device, unsigned int *milliwatts) {
  nvmlReturn_t result = device_call(device, milliwatts);
  if (result == NVML_SUCCESS) *milliwatts = gb10.power_mw;
  return result;
}

EXPORT nvmlReturn_t nvmlDeviceGetCurrentClocksEventReasons(nvmlDevice_t device, unsigned long long *reasons) {
  nvmlReturn_t result = device_call(device, reasons);
  if (result == NVML_SUCCESS) *reasons = gb10.event_reasons;
  return result;
}

/* The name before driver 535; the same bitmask. */
EXPORT nvmlReturn_t nvmlDeviceGetCurrentClocksThrottleReasons(nvmlDevice_t device, unsigned long long *reasons) {
  return nvmlDeviceGetCurrentClocksEventReasons(device, reasons);
}

/* Unified memory: GB10 has no framebuffer of its own to report. */
EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, void *memory) {
  nvmlReturn_t result = device_call(device, memory);
  return result == NVML_SUCCESS ? NVML_ERROR_NOT_SUPPORTED : result;
}

EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, void *memory) {
  return nvmlDeviceGetMemoryInfo(device, memory);
}
