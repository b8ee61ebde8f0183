package cli

import (
	"flag"
	"fmt"
	"slices"
	"strconv"
	"strings"

	"github.com/strata-llm/strata/engine"
	"github.com/strata-llm/strata/internal/infile"
	"github.com/strata-llm/strata/paging"
	"github.com/strata-llm/strata/tensor"
)

// DeviceSpecs turns -device and -devices into the engine's device specs:
// -device alone ("cpu", "cuda", "cuda:1", "auto"), or the devices of
// -device's driver numbered by -devices ("0,1" or "all"; "auto" picks the
// first GPU driver with a device, else the CPU's, whose numbered devices
// are independent CPU backends standing in for devices). ordinals are the
// device numbers per-device flag values ("0=3GiB,1=5GiB") refer to.
func DeviceSpecs(device, devices string) (specs []string, ordinals []int, err error) {
	if err := CheckDevice(device); err != nil {
		return nil, nil, err
	}
	if devices == "" {
		return []string{device}, []int{0}, nil
	}
	driver, _, _ := tensor.ParseDevice(device)
	here := tensor.Devices()
	if driver == "auto" {
		driver = "cpu"
		for _, d := range here {
			if name, _, _ := strings.Cut(d, ":"); name != "cpu" {
				driver = name
				break
			}
		}
	}
	if devices == "all" {
		if driver == "cpu" {
			return nil, nil, Usagef("-devices all needs a GPU device (-device cuda or auto; devices here: %s)", strings.Join(here, ", "))
		}
		for _, d := range here {
			if name, n, _ := tensor.ParseDevice(d); name == driver {
				ordinals = append(ordinals, n)
			}
		}
		if len(ordinals) == 0 {
			return nil, nil, fmt.Errorf("-devices all: no %s device (devices here: %s)", driver, strings.Join(here, ", "))
		}
	} else {
		for _, f := range strings.Split(devices, ",") {
			i, err := strconv.Atoi(strings.TrimSpace(f))
			if err != nil || i < 0 {
				return nil, nil, Usagef("-devices: %q is not a device number", f)
			}
			if slices.Contains(ordinals, i) {
				return nil, nil, Usagef("-devices: device %d given twice", i)
			}
			ordinals = append(ordinals, i)
		}
	}
	for _, i := range ordinals {
		specs = append(specs, fmt.Sprintf("%s:%d", driver, i))
	}
	return specs, ordinals, nil
}

// MemoryFlags are the memory flags every command that runs a model shares,
// with the same names and the same YAML config file (its memory: section);
// flags given on the command line override the file.
type MemoryFlags struct {
	GPULimit, GPUFraction, HostLimit, Offload, ConfigFile, Mode, CPULayers, ExpertPolicy, ExpertsCPU, KVCache, KVDType string
	// Threads is the -config file's cpu_threads once Resolve has read it
	// (0 when it sets none).
	Threads int
}

// Register adds the flags to fs.
func (m *MemoryFlags) Register(fs *flag.FlagSet) {
	fs.StringVar(&m.GPULimit, "gpu-memory-limit", "", "device memory budget `size` (3.5GiB, 800MiB, 4GB, 300000B; a bare number is GiB), or per device: 0=3GiB,1=5GiB")
	fs.StringVar(&m.GPUFraction, "gpu-memory-fraction", "", "device memory budget as a `fraction` of the device's total, or per device: 0=0.5,1=0.7")
	fs.StringVar(&m.HostLimit, "host-memory-limit", "", "host RAM `size` for caching streamed layers; beyond it they are re-read from disk")
	fs.StringVar(&m.Offload, "offload", "", "offload `strategy`: none, minimal, balanced, aggressive, hybrid (the CPU computes some of the layers that do not fit while the rest stream) or cpu (the CPU computes every layer that does not fit) (default: none without a budget, balanced with one)")
	fs.StringVar(&m.CPULayers, "cpu-layers", "", "with -offload hybrid: how many layers the CPU computes: auto (the planner's choice from the rates it measures), none, or a `count`")
	fs.StringVar(&m.ConfigFile, "config", "", "YAML config `file` with a memory: section; flags override it")
	fs.StringVar(&m.Mode, "memory-mode", "", "explicit, unified or unified-noprefetch (unified needs a device with unified memory, such as cuda)")
	fs.StringVar(&m.KVCache, "kv-cache", "", "where the KV cache lives: device (the default: all of it in the budget), host (every block's in host memory: decode attends on the CPU, prefill uploads it) or auto (the planner chooses per block from the measured rates)")
	fs.StringVar(&m.KVDType, "kv-dtype", "", "the KV cache's stored `dtype`: f32 (the default), f16, bf16, q8_b8 (8-bit blocks of 8 with an F16 scale, 10 bits a value) or q8_0 (blocks of 32, 8.5 bits a value)")
	fs.StringVar(&m.ExpertPolicy, "expert-policy", "", "a mixture of experts' expert cache `policy`: lru (the default) or lfu (aged use counts: better when a few experts are popular)")
	fs.StringVar(&m.ExpertsCPU, "experts-cpu", "", "a mixture of experts: when experts missing from the device's cache are computed on the CPU from host memory instead of uploaded: auto (the default: as many of a block's misses as the measured rates predict end the block soonest beside the others' uploads), never or always")
}

// Resolve merges the config file under the flags (set names the flags
// given on the command line) and parses the values into the engine's
// Memory, one budget per device of ordinals (a single value applies to
// each; "0=3GiB,1=5GiB" gives each its own, by device number).
func (m *MemoryFlags) Resolve(set map[string]bool, ordinals []int) (engine.Memory, error) {
	var mem engine.Memory
	var fc paging.MemoryConfig
	if m.ConfigFile != "" {
		if _, err := infile.Check(m.ConfigFile); err != nil { // a named pipe would block the read
			return mem, Usagef("-config: %v", err)
		}
		f, err := paging.LoadConfigFile(m.ConfigFile)
		if err != nil {
			return mem, UsageError{Err: err}
		}
		fc = f.Memory
	}
	pick := func(flagName, flagVal, fileVal string) string {
		if set[flagName] {
			return flagVal
		}
		return fileVal
	}
	gpuLimit := pick("gpu-memory-limit", m.GPULimit, fc.MaxGPUMemory)
	hostLimit := pick("host-memory-limit", m.HostLimit, fc.MaxHostMemory)
	offload := pick("offload", m.Offload, fc.OffloadStrategy)
	mode := pick("memory-mode", m.Mode, fc.MemoryMode)
	cpuLayers := pick("cpu-layers", m.CPULayers, fc.CPULayers)
	expertPolicy := pick("expert-policy", m.ExpertPolicy, fc.ExpertPolicy)
	expertsCPU := pick("experts-cpu", m.ExpertsCPU, fc.ExpertsCPU)
	kvCache := pick("kv-cache", m.KVCache, fc.KVCache)
	kvDType := pick("kv-dtype", m.KVDType, fc.KVDType)
	if fc.CPUThreads != "" {
		m.Threads, _ = strconv.Atoi(strings.TrimSpace(fc.CPUThreads)) // checked by LoadConfigFile
	}
	fraction := pick("gpu-memory-fraction", m.GPUFraction, fc.GPUMemoryFraction)
	if set["gpu-memory-fraction"] && set["gpu-memory-limit"] {
		return mem, Usagef("give -gpu-memory-limit or -gpu-memory-fraction, not both")
	}
	if set["gpu-memory-fraction"] {
		gpuLimit = ""
	} else if gpuLimit != "" {
		fraction = ""
	}
	for _, d := range ordinals {
		switch {
		case gpuLimit != "":
			v, err := paging.PerDevice(gpuLimit, d)
			if err != nil {
				return mem, Usagef("-gpu-memory-limit: %v", err)
			}
			n, err := paging.ParseSize(v)
			if err != nil {
				return mem, Usagef("-gpu-memory-limit: %v", err)
			}
			if n <= 0 {
				return mem, Usagef("-gpu-memory-limit %q must be positive", v)
			}
			mem.Budgets = append(mem.Budgets, n)
		case fraction != "":
			v, err := paging.PerDevice(fraction, d)
			if err != nil {
				return mem, Usagef("-gpu-memory-fraction: %v", err)
			}
			f, err := paging.ParseFraction(v)
			if err != nil {
				return mem, Usagef("-gpu-memory-fraction: %v", err)
			}
			mem.Fractions = append(mem.Fractions, f)
		}
	}
	var err error
	if hostLimit != "" {
		if mem.HostCache, err = paging.ParseSize(hostLimit); err != nil {
			return mem, Usagef("-host-memory-limit: %v", err)
		}
		if mem.HostCache == 0 {
			mem.HostCache = -1 // no host cache at all
		}
	}
	if offload != "" {
		if mem.Strategy, err = paging.ParseStrategy(offload); err != nil {
			return mem, Usagef("-offload: %v", err)
		}
	}
	if mode != "" {
		if mem.Mode, err = paging.ParseMemoryMode(mode); err != nil {
			return mem, Usagef("-memory-mode: %v", err)
		}
	}
	if expertPolicy != "" {
		if mem.ExpertPolicy, err = paging.ParseExpertPolicy(expertPolicy); err != nil {
			return mem, Usagef("-expert-policy: %v", err)
		}
	}
	if expertsCPU != "" {
		if mem.ExpertsCPU, err = paging.ParseExpertCPUPolicy(expertsCPU); err != nil {
			return mem, Usagef("-experts-cpu: %v", err)
		}
	}
	if kvCache != "" {
		if mem.KVCache, err = paging.ParseKVPlacement(kvCache); err != nil {
			return mem, Usagef("-kv-cache: %v", err)
		}
	}
	if mem.KVDType, err = tensor.ParseCacheDType(kvDType); err != nil {
		return mem, Usagef("-kv-dtype: %v", strings.TrimPrefix(err.Error(), "tensor: "))
	}
	if mem.CPULayers, err = paging.ParseCPULayers(cpuLayers); err != nil {
		return mem, Usagef("-cpu-layers: %v", err)
	}
	if cpuLayers != "" && mem.Strategy != paging.StrategyHybrid {
		return mem, Usagef("-cpu-layers needs -offload hybrid")
	}
	return mem, nil
}

// CheckPlacement refuses, as usage errors, memory settings the devices of
// specs (from DeviceSpecs) cannot run: the hybrid and cpu strategies
// compute beside a GPU, and the unified memory modes need one.
func CheckPlacement(mem engine.Memory, specs []string) error {
	onCPU := len(specs) > 0 && strings.HasPrefix(specs[0], "cpu")
	if (mem.Strategy == paging.StrategyHybrid || mem.Strategy == paging.StrategyCPU) && onCPU {
		return Usagef("-offload %s computes beside a GPU: give -device cuda (running on cpu)", mem.Strategy)
	}
	if mem.Mode != "" && mem.Mode != paging.ModeExplicit && onCPU {
		return Usagef("-memory-mode %s needs a device with unified memory, such as -device cuda (running on cpu)", mem.Mode)
	}
	return nil
}
