/*
 * A stand-in for NVIDIA's libnvidia-ml.so.1, for tests on machines without an NVIDIA GPU:
 * the NVML functions kernelkite calls (crates/sys/src/nvml.rs, through nvml-wrapper 0.13),
 * with the values a test writes to a file. Built by the tests with the system's C compiler
 * (kernelkite_testkit::fake_nvml) and loaded through the real loader, so every NVML path of
 * kernelkite runs as it runs on a GPU node.
 *
 * Signatures, structure layouts and return codes follow NVIDIA's nvml.h as nvml-wrapper-sys
 * 0.10's bindings give them (nvmlPciInfo_t, nvmlMemory_v2_t, nvmlProcessInfo_t,
 * nvmlReturn_t); written here, not copied.
 *
 * KERNELKITE_FAKE_NVML names the file, read at nvmlInit_v2; one item per line:
 *   gpu <bus id> <uuid> <minor> <max graphics MHz> <memory used bytes> <name ...>
 *   proc <bus id, or a MIG device's uuid> <pid> <used bytes>
 *   mig <parent bus id> <gpu instance id> <compute instance id> <uuid> <memory bytes> <name ...>
 *       (a MIG device; a GPU with any is in MIG mode, and its MIG devices are numbered
 *       0.. in the order given, as nvmlDeviceGetMigDeviceHandleByIndex numbers them)
 *   migmode <bus id> <current 0|1> <pending 0|1>
 *       (the GPU's MIG mode as nvmlDeviceGetMigMode reports it, whatever MIG devices it has:
 *       MIG on with none yet, or a change pending until the GPU's next reset; without it,
 *       a GPU is in MIG mode when it has MIG devices)
 *   nvlink <bus id> <bus id>   (the two GPUs are NVLink peers, both ways)
 *   health <bus id, or a MIG device's uuid> <SM MHz> <memory MHz> <power limit mW> <temperature C>
 *          <uncorrected ECC errors> <clock event reason bits, hex> <max SM MHz> <VBIOS version>
 *       (what the device reports of its state; a device without a line answers NOT_SUPPORTED
 *       to those calls, as a GPU or MIG device that does not report them does)
 *   driver <version>   (nvmlSystemGetDriverVersion's answer; NOT_SUPPORTED without it)
 *   fail <function name> <nvmlReturn_t code>
 * KERNELKITE_FAKE_NVML_LOG, if set, names a file each call that changes something is
 * appended to ("lock <bus id> <min> <max>", "reset <bus id>").
 * KERNELKITE_FAKE_NVML_DEV, if set, names the directory standing for /dev: a GPU whose
 * nvidia<minor> is not there is one this process may not open, and as NVML does for such a
 * GPU (nvml.h, nvmlDeviceGetCount_v2 and nvmlDeviceGetHandleByIndex_v2), the count still
 * includes it while its handle, by index or by bus id, is NO_PERMISSION.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#define NVML_SUCCESS 0
#define NVML_ERROR_UNINITIALIZED 1
#define NVML_ERROR_INVALID_ARGUMENT 2
#define NVML_ERROR_NOT_SUPPORTED 3
#define NVML_ERROR_NO_PERMISSION 4
#define NVML_ERROR_NOT_FOUND 6
#define NVML_ERROR_INSUFFICIENT_SIZE 7
#define NVML_ERROR_ARGUMENT_VERSION_MISMATCH 25
#define NVML_ERROR_UNKNOWN 999

#define MAX_GPUS 16
#define MAX_PROCS 64
#define MAX_FAILS 32
#define MAX_MIGS 64
#define MAX_LINKS 64
/* nvmlDeviceGetMaxMigDeviceCount on an H100 / A100: seven 1g instances at most. */
#define MAX_MIG_PER_GPU 7

typedef int nvmlReturn_t;

typedef struct {
    char busIdLegacy[16];
    unsigned int domain, bus, device, pciDeviceId, pciSubSystemId;
    char busId[32];
} nvmlPciInfo_t;

typedef struct {
    unsigned int version;
    unsigned long long total, reserved, free, used;
} nvmlMemory_v2_t;

typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId, computeInstanceId;
} nvmlProcessInfo_t;

struct fake_gpu {
    char bus[32];
    char uuid[96];
    unsigned int minor, max_clock;
    unsigned long long mem_used;
    char name[96];
    /* MIG devices only: the parent GPU, the instance ids and the memory size. */
    struct fake_gpu *parent;
    unsigned int gi, ci;
    unsigned long long mem_total;
};
typedef struct fake_gpu *nvmlDevice_t;

struct fake_proc {
    char bus[96]; /* a bus id, or a MIG device's uuid */
    unsigned int pid;
    unsigned long long used;
};

struct fake_fail {
    char function[64];
    nvmlReturn_t code;
};

struct fake_link {
    char a[32], b[32];
};

struct fake_mode {
    char bus[32];
    unsigned int current, pending;
};

struct fake_health {
    char id[96]; /* a bus id, or a MIG device's uuid */
    unsigned int sm, mem, power_mw, temp, max_sm;
    unsigned long long ecc, reasons;
    char vbios[64];
};

static struct fake_gpu gpus[MAX_GPUS];
static struct fake_gpu migs[MAX_MIGS];
static struct fake_proc procs[MAX_PROCS];
static struct fake_fail fails[MAX_FAILS];
static struct fake_link links[MAX_LINKS];
static struct fake_mode modes[MAX_GPUS];
static struct fake_health healths[MAX_GPUS + MAX_MIGS];
static unsigned int n_gpus, n_migs, n_procs, n_fails, n_links, n_modes, n_healths;
static char driver[80];
static int initialised;

static void log_line(const char *fmt, const char *a, unsigned int b, unsigned int c)
{
    const char *path = getenv("KERNELKITE_FAKE_NVML_LOG");
    if (!path)
        return;
    FILE *f = fopen(path, "a");
    if (!f)
        return;
    fprintf(f, fmt, a, b, c);
    fclose(f);
}

/* The code a test asked `function` to fail with, or NVML_SUCCESS. */
static nvmlReturn_t failure(const char *function)
{
    for (unsigned int i = 0; i < n_fails; i++)
        if (strcmp(fails[i].function, function) == 0)
            return fails[i].code;
    return NVML_SUCCESS;
}

#define ENTER(name)                                 \
    do {                                            \
        nvmlReturn_t injected_ = failure(name);     \
        if (injected_ != NVML_SUCCESS)              \
            return injected_;                       \
        if (!initialised)                           \
            return NVML_ERROR_UNINITIALIZED;        \
    } while (0)

static void read_config(void)
{
    n_gpus = n_migs = n_procs = n_fails = n_links = n_modes = n_healths = 0;
    driver[0] = 0;
    char parents[MAX_MIGS][32];
    const char *path = getenv("KERNELKITE_FAKE_NVML");
    if (!path)
        return;
    FILE *f = fopen(path, "r");
    if (!f)
        return;
    char line[512];
    while (fgets(line, sizeof line, f)) {
        line[strcspn(line, "\n")] = 0;
        if (strncmp(line, "gpu ", 4) == 0 && n_gpus < MAX_GPUS) {
            struct fake_gpu *g = &gpus[n_gpus];
            int used = 0;
            if (sscanf(line + 4, "%31s %95s %u %u %llu %n", g->bus, g->uuid, &g->minor,
                       &g->max_clock, &g->mem_used, &used) >= 5) {
                snprintf(g->name, sizeof g->name, "%s", line + 4 + used);
                n_gpus++;
            }
        } else if (strncmp(line, "proc ", 5) == 0 && n_procs < MAX_PROCS) {
            struct fake_proc *p = &procs[n_procs];
            if (sscanf(line + 5, "%95s %u %llu", p->bus, &p->pid, &p->used) == 3)
                n_procs++;
        } else if (strncmp(line, "mig ", 4) == 0 && n_migs < MAX_MIGS) {
            struct fake_gpu *m = &migs[n_migs];
            int used = 0;
            memset(m, 0, sizeof *m);
            if (sscanf(line + 4, "%31s %u %u %95s %llu %n", parents[n_migs], &m->gi, &m->ci,
                       m->uuid, &m->mem_total, &used) >= 5) {
                snprintf(m->name, sizeof m->name, "%s", line + 4 + used);
                n_migs++;
            }
        } else if (strncmp(line, "migmode ", 8) == 0 && n_modes < MAX_GPUS) {
            struct fake_mode *m = &modes[n_modes];
            if (sscanf(line + 8, "%31s %u %u", m->bus, &m->current, &m->pending) == 3)
                n_modes++;
        } else if (strncmp(line, "nvlink ", 7) == 0 && n_links < MAX_LINKS) {
            struct fake_link *l = &links[n_links];
            if (sscanf(line + 7, "%31s %31s", l->a, l->b) == 2)
                n_links++;
        } else if (strncmp(line, "health ", 7) == 0 && n_healths < MAX_GPUS + MAX_MIGS) {
            struct fake_health *h = &healths[n_healths];
            if (sscanf(line + 7, "%95s %u %u %u %u %llu %llx %u %63s", h->id, &h->sm, &h->mem,
                       &h->power_mw, &h->temp, &h->ecc, &h->reasons, &h->max_sm, h->vbios) == 9)
                n_healths++;
        } else if (strncmp(line, "driver ", 7) == 0) {
            if (sscanf(line + 7, "%79s", driver) != 1)
                driver[0] = 0;
        } else if (strncmp(line, "fail ", 5) == 0 && n_fails < MAX_FAILS) {
            struct fake_fail *x = &fails[n_fails];
            if (sscanf(line + 5, "%63s %d", x->function, &x->code) == 2)
                n_fails++;
        }
    }
    fclose(f);
    /* Parents are named by bus id; GPU lines may come after the MIG lines. */
    unsigned int kept = 0;
    for (unsigned int i = 0; i < n_migs; i++) {
        struct fake_gpu *parent = NULL;
        for (unsigned int g = 0; g < n_gpus; g++)
            if (strcasecmp(gpus[g].bus, parents[i]) == 0)
                parent = &gpus[g];
        if (!parent)
            continue;
        migs[kept] = migs[i];
        migs[kept].parent = parent;
        snprintf(migs[kept].bus, sizeof migs[kept].bus, "%s", parent->bus);
        migs[kept].minor = parent->minor;
        kept++;
    }
    n_migs = kept;
}

/* The state a `health` line gave `device` (a MIG device by its uuid), or NULL. */
static const struct fake_health *health_of(const struct fake_gpu *device)
{
    const char *id = device->parent ? device->uuid : device->bus;
    for (unsigned int i = 0; i < n_healths; i++)
        if (strcasecmp(healths[i].id, id) == 0)
            return &healths[i];
    return NULL;
}

/* The MIG mode a `migmode` line gave `gpu`, or NULL. */
static const struct fake_mode *mode_of(const struct fake_gpu *gpu)
{
    for (unsigned int i = 0; i < n_modes; i++)
        if (strcasecmp(modes[i].bus, gpu->bus) == 0)
            return &modes[i];
    return NULL;
}

/* The MIG devices of `gpu`, in the order the configuration gave them. */
static unsigned int mig_count(const struct fake_gpu *gpu)
{
    unsigned int n = 0;
    for (unsigned int i = 0; i < n_migs; i++)
        if (migs[i].parent == gpu)
            n++;
    return n;
}

nvmlReturn_t nvmlInit_v2(void)
{
    read_config();
    nvmlReturn_t injected = failure("nvmlInit_v2");
    if (injected != NVML_SUCCESS)
        return injected;
    initialised = 1;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlShutdown(void)
{
    initialised = 0;
    return NVML_SUCCESS;
}

const char *nvmlErrorString(nvmlReturn_t result)
{
    if (result == NVML_SUCCESS)
        return "Success";
    /* nvml.h's text for it, which nvidia-smi prints for a GPU it may not open. */
    return result == NVML_ERROR_NO_PERMISSION ? "Insufficient Permissions" : "fake NVML error";
}

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count)
{
    ENTER("nvmlDeviceGetCount_v2");
    if (!count)
        return NVML_ERROR_INVALID_ARGUMENT;
    *count = n_gpus;
    return NVML_SUCCESS;
}

/* Whether this process may open `g` (KERNELKITE_FAKE_NVML_DEV): its node exists. Checked by
 * name, not opened: a test's fake nodes carry numbers no driver of the machine answers. */
static int may_open(const struct fake_gpu *g)
{
    const char *dev = getenv("KERNELKITE_FAKE_NVML_DEV");
    if (!dev)
        return 1;
    char path[512];
    snprintf(path, sizeof path, "%s/nvidia%u", dev, g->minor);
    return access(path, F_OK) == 0;
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device)
{
    ENTER("nvmlDeviceGetHandleByIndex_v2");
    if (!device || index >= n_gpus)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (!may_open(&gpus[index]))
        return NVML_ERROR_NO_PERMISSION;
    *device = &gpus[index];
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetHandleByPciBusId_v2(const char *bus_id, nvmlDevice_t *device)
{
    ENTER("nvmlDeviceGetHandleByPciBusId_v2");
    if (!bus_id || !device)
        return NVML_ERROR_INVALID_ARGUMENT;
    /* NVML takes "0000:18:00.0" and the 8-digit domain form alike, any case. */
    const char *want = bus_id;
    if (strlen(want) == 16 && strncmp(want, "0000", 4) == 0)
        want += 4;
    for (unsigned int i = 0; i < n_gpus; i++) {
        if (strcasecmp(gpus[i].bus, want) == 0) {
            if (!may_open(&gpus[i]))
                return NVML_ERROR_NO_PERMISSION;
            *device = &gpus[i];
            return NVML_SUCCESS;
        }
    }
    return NVML_ERROR_NOT_FOUND;
}

static nvmlReturn_t copy_out(const char *value, char *buf, unsigned int length)
{
    if (!buf)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(value) + 1 > length)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(buf, value, strlen(value) + 1);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length)
{
    ENTER("nvmlDeviceGetName");
    return device ? copy_out(device->name, name, length) : NVML_ERROR_INVALID_ARGUMENT;
}

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length)
{
    ENTER("nvmlDeviceGetUUID");
    return device ? copy_out(device->uuid, uuid, length) : NVML_ERROR_INVALID_ARGUMENT;
}

nvmlReturn_t nvmlDeviceGetMinorNumber(nvmlDevice_t device, unsigned int *minor)
{
    ENTER("nvmlDeviceGetMinorNumber");
    if (!device || !minor)
        return NVML_ERROR_INVALID_ARGUMENT;
    *minor = device->minor;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, nvmlPciInfo_t *pci)
{
    ENTER("nvmlDeviceGetPciInfo_v3");
    if (!device || !pci)
        return NVML_ERROR_INVALID_ARGUMENT;
    memset(pci, 0, sizeof *pci);
    unsigned int domain = 0, bus = 0, dev = 0, fn = 0;
    sscanf(device->bus, "%x:%x:%x.%x", &domain, &bus, &dev, &fn);
    pci->domain = domain;
    pci->bus = bus;
    pci->device = dev;
    pci->pciDeviceId = 0x233010de; /* H100 SXM5, vendor 0x10de */
    /* NVML writes the 8-digit domain form, upper-case. */
    snprintf(pci->busId, sizeof pci->busId, "%08X:%02X:%02X.%X", domain, bus, dev, fn);
    snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, "%04X:%02X:%02X.%X", domain, bus, dev,
             fn);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory)
{
    ENTER("nvmlDeviceGetMemoryInfo_v2");
    if (!device || !memory)
        return NVML_ERROR_INVALID_ARGUMENT;
    /* NVML_STRUCT_VERSION(Memory, 2): the caller must say which layout it passes. */
    if (memory->version != (unsigned int)(sizeof(nvmlMemory_v2_t) | (2u << 24)))
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    memory->total = device->parent ? device->mem_total : 80ULL << 30;
    memory->reserved = 0;
    memory->used = device->mem_used;
    memory->free = memory->total - device->mem_used;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device, unsigned int *count,
                                                     nvmlProcessInfo_t *infos)
{
    ENTER("nvmlDeviceGetComputeRunningProcesses_v3");
    if (!device || !count)
        return NVML_ERROR_INVALID_ARGUMENT;
    /* A MIG device's processes are named by its uuid; a GPU's by its bus id. */
    const char *key = device->parent ? device->uuid : device->bus;
    unsigned int mine = 0;
    for (unsigned int i = 0; i < n_procs; i++)
        if (strcasecmp(procs[i].bus, key) == 0)
            mine++;
    if (!infos || *count < mine) {
        /* NVML's contract: the count needed, and INSUFFICIENT_SIZE unless there is none. */
        *count = mine;
        return mine == 0 ? NVML_SUCCESS : NVML_ERROR_INSUFFICIENT_SIZE;
    }
    unsigned int k = 0;
    for (unsigned int i = 0; i < n_procs; i++) {
        if (strcasecmp(procs[i].bus, key) != 0)
            continue;
        infos[k].pid = procs[i].pid;
        infos[k].usedGpuMemory = procs[i].used;
        infos[k].gpuInstanceId = device->parent ? device->gi : 0xFFFFFFFF;
        infos[k].computeInstanceId = device->parent ? device->ci : 0xFFFFFFFF;
        k++;
    }
    *count = k;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMaxClockInfo(nvmlDevice_t device, int type, unsigned int *clock)
{
    ENTER("nvmlDeviceGetMaxClockInfo");
    if (!device || !clock)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (type == 0 /* NVML_CLOCK_GRAPHICS */) {
        *clock = device->max_clock;
        return NVML_SUCCESS;
    }
    const struct fake_health *h = health_of(device);
    if (type != 1 /* NVML_CLOCK_SM */ || !h)
        return NVML_ERROR_NOT_SUPPORTED;
    *clock = h->max_sm;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetClockInfo(nvmlDevice_t device, int type, unsigned int *clock)
{
    ENTER("nvmlDeviceGetClockInfo");
    if (!device || !clock)
        return NVML_ERROR_INVALID_ARGUMENT;
    const struct fake_health *h = health_of(device);
    if (!h || (type != 1 /* NVML_CLOCK_SM */ && type != 2 /* NVML_CLOCK_MEM */))
        return NVML_ERROR_NOT_SUPPORTED;
    *clock = type == 1 ? h->sm : h->mem;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetEnforcedPowerLimit(nvmlDevice_t device, unsigned int *limit)
{
    ENTER("nvmlDeviceGetEnforcedPowerLimit");
    if (!device || !limit)
        return NVML_ERROR_INVALID_ARGUMENT;
    const struct fake_health *h = health_of(device);
    if (!h)
        return NVML_ERROR_NOT_SUPPORTED;
    *limit = h->power_mw;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t device, int sensor, unsigned int *temp)
{
    ENTER("nvmlDeviceGetTemperature");
    if (!device || !temp || sensor != 0 /* NVML_TEMPERATURE_GPU */)
        return NVML_ERROR_INVALID_ARGUMENT;
    const struct fake_health *h = health_of(device);
    if (!h)
        return NVML_ERROR_NOT_SUPPORTED;
    *temp = h->temp;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetTotalEccErrors(nvmlDevice_t device, int error_type, int counter_type,
                                         unsigned long long *count)
{
    ENTER("nvmlDeviceGetTotalEccErrors");
    if (!device || !count)
        return NVML_ERROR_INVALID_ARGUMENT;
    const struct fake_health *h = health_of(device);
    /* Only the uncorrected (1), volatile (0) counter is kept here. */
    if (!h || error_type != 1 || counter_type != 0)
        return NVML_ERROR_NOT_SUPPORTED;
    *count = h->ecc;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetCurrentClocksThrottleReasons(nvmlDevice_t device,
                                                       unsigned long long *reasons)
{
    ENTER("nvmlDeviceGetCurrentClocksThrottleReasons");
    if (!device || !reasons)
        return NVML_ERROR_INVALID_ARGUMENT;
    const struct fake_health *h = health_of(device);
    if (!h)
        return NVML_ERROR_NOT_SUPPORTED;
    *reasons = h->reasons;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetVbiosVersion(nvmlDevice_t device, char *version, unsigned int length)
{
    ENTER("nvmlDeviceGetVbiosVersion");
    if (!device)
        return NVML_ERROR_INVALID_ARGUMENT;
    const struct fake_health *h = health_of(device);
    if (!h)
        return NVML_ERROR_NOT_SUPPORTED;
    return copy_out(h->vbios, version, length);
}

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length)
{
    ENTER("nvmlSystemGetDriverVersion");
    if (!driver[0])
        return NVML_ERROR_NOT_SUPPORTED;
    return copy_out(driver, version, length);
}

nvmlReturn_t nvmlDeviceSetGpuLockedClocks(nvmlDevice_t device, unsigned int min_mhz,
                                          unsigned int max_mhz)
{
    ENTER("nvmlDeviceSetGpuLockedClocks");
    if (!device || min_mhz > max_mhz || max_mhz > device->max_clock)
        return NVML_ERROR_INVALID_ARGUMENT;
    log_line("lock %s %u %u\n", device->bus, min_mhz, max_mhz);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceResetGpuLockedClocks(nvmlDevice_t device)
{
    ENTER("nvmlDeviceResetGpuLockedClocks");
    if (!device)
        return NVML_ERROR_INVALID_ARGUMENT;
    log_line("reset %s\n", device->bus, 0, 0);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device)
{
    ENTER("nvmlDeviceGetHandleByUUID");
    if (!uuid || !device)
        return NVML_ERROR_INVALID_ARGUMENT;
    for (unsigned int i = 0; i < n_gpus; i++) {
        if (strcmp(gpus[i].uuid, uuid) == 0) {
            *device = &gpus[i];
            return NVML_SUCCESS;
        }
    }
    /* NVML finds MIG devices by their MIG-… uuid too (R470 and later). */
    for (unsigned int i = 0; i < n_migs; i++) {
        if (strcmp(migs[i].uuid, uuid) == 0) {
            *device = &migs[i];
            return NVML_SUCCESS;
        }
    }
    return NVML_ERROR_NOT_FOUND;
}

nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t device, unsigned int *current,
                                  unsigned int *pending)
{
    ENTER("nvmlDeviceGetMigMode");
    if (!device || !current || !pending || device->parent)
        return NVML_ERROR_INVALID_ARGUMENT;
    /* NVML_DEVICE_MIG_ENABLE is 1. */
    const struct fake_mode *m = mode_of(device);
    *current = m ? m->current : (mig_count(device) > 0 ? 1 : 0);
    *pending = m ? m->pending : *current;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMaxMigDeviceCount(nvmlDevice_t device, unsigned int *count)
{
    ENTER("nvmlDeviceGetMaxMigDeviceCount");
    if (!device || !count || device->parent)
        return NVML_ERROR_INVALID_ARGUMENT;
    /* The most MIG devices the GPU can hold while in MIG mode, whether it holds any yet. */
    const struct fake_mode *m = mode_of(device);
    unsigned int on = m ? m->current : (mig_count(device) > 0 ? 1 : 0);
    *count = on ? MAX_MIG_PER_GPU : 0;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMigDeviceHandleByIndex(nvmlDevice_t device, unsigned int index,
                                                 nvmlDevice_t *mig)
{
    ENTER("nvmlDeviceGetMigDeviceHandleByIndex");
    if (!device || !mig || device->parent)
        return NVML_ERROR_INVALID_ARGUMENT;
    unsigned int seen = 0;
    for (unsigned int i = 0; i < n_migs; i++) {
        if (migs[i].parent != device)
            continue;
        if (seen++ == index) {
            *mig = &migs[i];
            return NVML_SUCCESS;
        }
    }
    /* Indices up to the maximum count that hold no MIG device are NOT_FOUND, as in NVML. */
    return index < MAX_MIG_PER_GPU ? NVML_ERROR_NOT_FOUND : NVML_ERROR_INVALID_ARGUMENT;
}

nvmlReturn_t nvmlDeviceIsMigDeviceHandle(nvmlDevice_t device, unsigned int *is_mig)
{
    ENTER("nvmlDeviceIsMigDeviceHandle");
    if (!device || !is_mig)
        return NVML_ERROR_INVALID_ARGUMENT;
    *is_mig = device->parent != NULL;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetGpuInstanceId(nvmlDevice_t device, unsigned int *id)
{
    ENTER("nvmlDeviceGetGpuInstanceId");
    if (!device || !id || !device->parent)
        return NVML_ERROR_INVALID_ARGUMENT;
    *id = device->gi;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetComputeInstanceId(nvmlDevice_t device, unsigned int *id)
{
    ENTER("nvmlDeviceGetComputeInstanceId");
    if (!device || !id || !device->parent)
        return NVML_ERROR_INVALID_ARGUMENT;
    *id = device->ci;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetP2PStatus(nvmlDevice_t a, nvmlDevice_t b, int index, int *status)
{
    ENTER("nvmlDeviceGetP2PStatus");
    if (!a || !b || !status)
        return NVML_ERROR_INVALID_ARGUMENT;
    /* NVML_P2P_CAPS_INDEX_NVLINK is 2; NVML_P2P_STATUS_OK 0, _NOT_SUPPORTED 5. */
    if (index != 2) {
        *status = 5;
        return NVML_SUCCESS;
    }
    *status = 5;
    for (unsigned int i = 0; i < n_links; i++) {
        if ((strcasecmp(links[i].a, a->bus) == 0 && strcasecmp(links[i].b, b->bus) == 0)
            || (strcasecmp(links[i].a, b->bus) == 0 && strcasecmp(links[i].b, a->bus) == 0))
            *status = 0;
    }
    return NVML_SUCCESS;
}
