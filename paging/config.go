package paging

import (
	"context"
	"fmt"
	"reflect"
	"strconv"
	"strings"

	"go.yaml.in/yaml/v3"

	"github.com/strata-llm/strata/internal/infile"
	"github.com/strata-llm/strata/internal/oneline"
	"github.com/strata-llm/strata/tensor"
)

// MemoryMode says how weights reach the device.
type MemoryMode string

// The memory modes.
const (
	// ModeExplicit copies layers into device memory under the budget.
	ModeExplicit MemoryMode = "explicit"
	// ModeUnified uses managed memory: resident layers prefetched to the
	// device, streamed layers mapped for it and read in place.
	ModeUnified MemoryMode = "unified"
	// ModeUnifiedNoPrefetch uses managed memory and lets pages fault in.
	ModeUnifiedNoPrefetch MemoryMode = "unified-noprefetch"
)

// ParseMemoryMode accepts "explicit", "unified" and "unified-noprefetch".
func ParseMemoryMode(s string) (MemoryMode, error) {
	switch m := MemoryMode(strings.ToLower(strings.TrimSpace(s))); m {
	case ModeExplicit, ModeUnified, ModeUnifiedNoPrefetch:
		return m, nil
	}
	return "", fmt.Errorf("paging: unknown memory mode %q (want explicit, unified or unified-noprefetch)", s)
}

// MemoryConfig is the memory: section of a config file. Sizes are strings
// for ParseSize ("3.5GiB", "800MiB", a bare number is GiB); the GPU budget
// and fraction may be given per device ("0=3GiB,1=5GiB", "0=0.5,1=0.7").
// Empty fields are unset, and the CLI's flags override what is set.
type MemoryConfig struct {
	OffloadStrategy   string `yaml:"offload_strategy"`
	MaxGPUMemory      string `yaml:"max_gpu_memory"`
	MaxHostMemory     string `yaml:"max_host_memory"`
	MemoryMode        string `yaml:"memory_mode"`
	GPUMemoryFraction string `yaml:"gpu_memory_fraction"`
	// CPULayers and CPUThreads are the hybrid strategy's: how many layers
	// the CPU computes ("auto" or empty lets the planner choose, a count
	// forces it) and how many threads it computes them with (0 or empty
	// is every core).
	CPULayers  string `yaml:"cpu_layers"`
	CPUThreads string `yaml:"cpu_threads"`
	// ExpertPolicy is the expert cache's eviction policy for a mixture of
	// experts: lru or lfu (ParseExpertPolicy).
	ExpertPolicy string `yaml:"expert_policy"`
	// ExpertsCPU says when experts missing from the expert cache are
	// computed on the CPU instead of uploaded: auto (a split of each
	// block's misses), never or always (ParseExpertCPUPolicy).
	ExpertsCPU string `yaml:"experts_cpu"`
	// KVCache places the KV cache: auto, device or host
	// (ParseKVPlacement).
	KVCache string `yaml:"kv_cache"`
	// KVDType is the stored dtype of the KV cache: f32 (the default),
	// f16, bf16, q8_b8 or q8_0 (tensor.ParseCacheDType).
	KVDType string `yaml:"kv_dtype"`
}

// ParseCPULayers reads a cpu_layers value: "auto" (or empty) is 0, which
// lets the planner choose; "none" or a negative count is -1; a count
// forces that many.
func ParseCPULayers(s string) (int, error) {
	switch v := strings.ToLower(strings.TrimSpace(s)); v {
	case "", "auto":
		return 0, nil
	case "none":
		return -1, nil
	default:
		n, err := strconv.Atoi(v)
		if err != nil {
			return 0, fmt.Errorf("cpu layers %q: want auto, none or a count", s)
		}
		if n == 0 {
			return -1, nil // zero layers on the CPU
		}
		return max(n, -1), nil
	}
}

// PerDevice returns device's value from "V" (the same for every device) or
// "0=V0,1=V1" (by device number).
func PerDevice(s string, device int) (string, error) {
	if !strings.Contains(s, "=") {
		return s, nil
	}
	for _, part := range strings.Split(s, ",") {
		k, val, found := strings.Cut(strings.TrimSpace(part), "=")
		n, err := strconv.Atoi(strings.TrimSpace(k))
		if !found || err != nil || n < 0 {
			return "", fmt.Errorf("%q: want DEVICE=VALUE pairs like 0=3GiB,1=5GiB", part)
		}
		if n == device {
			return strings.TrimSpace(val), nil
		}
	}
	return "", fmt.Errorf("%q names no value for device %d", s, device)
}

// eachDevice checks every value of a per-device setting with parse.
func eachDevice(s string, parse func(string) error) error {
	if !strings.Contains(s, "=") {
		return parse(s)
	}
	for _, part := range strings.Split(s, ",") {
		k, val, found := strings.Cut(strings.TrimSpace(part), "=")
		if _, err := strconv.Atoi(strings.TrimSpace(k)); !found || err != nil {
			return fmt.Errorf("%q: want DEVICE=VALUE pairs like 0=3GiB,1=5GiB", part)
		}
		if err := parse(strings.TrimSpace(val)); err != nil {
			return err
		}
	}
	return nil
}

// ParseFraction reads a memory fraction in (0, 1].
func ParseFraction(s string) (float64, error) {
	f, err := strconv.ParseFloat(strings.TrimSpace(s), 64)
	if err != nil || !(f > 0 && f <= 1) {
		return 0, fmt.Errorf("memory fraction %q is not a number in (0, 1]", s)
	}
	return f, nil
}

// FileConfig is a strata YAML config file.
type FileConfig struct {
	Memory MemoryConfig `yaml:"memory"`
}

// LoadConfigFile reads a YAML config file and checks it: its only section
// is memory:, so an empty file, an empty memory section, an unknown section
// (a misspelt memory:) or key, and unparsable sizes, strategies or modes
// are errors naming the file, each on one line.
func LoadConfigFile(path string) (*FileConfig, error) {
	data, err := infile.ReadFile(context.Background(), path) // a FIFO or a device is refused, not read
	if err != nil {
		return nil, fmt.Errorf("paging: config: %w", err)
	}
	fail := func(format string, a ...any) error {
		return fmt.Errorf("paging: config %s: %s", path, oneline.String(fmt.Sprintf(format, a...)))
	}
	var doc yaml.Node
	if err := yaml.Unmarshal(data, &doc); err != nil {
		return nil, fmt.Errorf("paging: config %s: %w", path, oneline.Error(err))
	}
	if len(doc.Content) == 0 {
		return nil, fail("empty: want a memory: section")
	}
	root := doc.Content[0]
	if root.Kind != yaml.MappingNode {
		return nil, fail("line %d: want a mapping with a memory: section", root.Line)
	}
	var mem *yaml.Node
	for i := 0; i+1 < len(root.Content); i += 2 {
		k := root.Content[i]
		switch {
		case k.Value != "memory":
			return nil, fail("line %d: unknown section %q (the only section is memory:)", k.Line, k.Value)
		case mem != nil:
			return nil, fail("line %d: a second memory: section", k.Line)
		}
		mem = root.Content[i+1]
	}
	if mem == nil || mem.Kind == yaml.ScalarNode && mem.Tag == "!!null" {
		return nil, fail("the memory: section is empty")
	}
	if mem.Kind != yaml.MappingNode {
		return nil, fail("line %d: memory: want a mapping of settings", mem.Line)
	}
	// Keys are checked here, with the file's line numbers: a misspelt key
	// is an error, not a silent default.
	known := map[string]bool{}
	mt := reflect.TypeFor[MemoryConfig]()
	for i := range mt.NumField() {
		known[mt.Field(i).Tag.Get("yaml")] = true
	}
	for i := 0; i+1 < len(mem.Content); i += 2 {
		if k := mem.Content[i]; !known[k.Value] {
			return nil, fail("line %d: memory: unknown key %q", k.Line, k.Value)
		}
	}
	var fc FileConfig
	if err := mem.Decode(&fc.Memory); err != nil {
		return nil, fmt.Errorf("paging: config %s: memory: %w", path, oneline.Error(err))
	}
	if err := fc.Memory.Validate(); err != nil {
		return nil, fmt.Errorf("paging: config %s: %w", path, oneline.Error(err))
	}
	return &fc, nil
}

// Validate checks that every set field parses.
func (m *MemoryConfig) Validate() error {
	if m.OffloadStrategy != "" {
		if _, err := ParseStrategy(m.OffloadStrategy); err != nil {
			return fmt.Errorf("memory.offload_strategy: %w", err)
		}
	}
	if m.MaxGPUMemory != "" {
		if err := eachDevice(m.MaxGPUMemory, func(v string) error { _, err := ParseSize(v); return err }); err != nil {
			return fmt.Errorf("memory.max_gpu_memory: %w", err)
		}
	}
	if m.MaxHostMemory != "" {
		if _, err := ParseSize(m.MaxHostMemory); err != nil {
			return fmt.Errorf("memory.max_host_memory: %w", err)
		}
	}
	if m.MemoryMode != "" {
		if _, err := ParseMemoryMode(m.MemoryMode); err != nil {
			return fmt.Errorf("memory.memory_mode: %w", err)
		}
	}
	if m.GPUMemoryFraction != "" {
		if err := eachDevice(m.GPUMemoryFraction, func(v string) error { _, err := ParseFraction(v); return err }); err != nil {
			return fmt.Errorf("memory.gpu_memory_fraction: %w", err)
		}
	}
	if _, err := ParseCPULayers(m.CPULayers); err != nil {
		return fmt.Errorf("memory.cpu_layers: %w", err)
	}
	if _, err := ParseExpertPolicy(m.ExpertPolicy); err != nil {
		return fmt.Errorf("memory.expert_policy: %w", err)
	}
	if _, err := ParseExpertCPUPolicy(m.ExpertsCPU); err != nil {
		return fmt.Errorf("memory.experts_cpu: %w", err)
	}
	if _, err := ParseKVPlacement(m.KVCache); err != nil {
		return fmt.Errorf("memory.kv_cache: %w", err)
	}
	if _, err := tensor.ParseCacheDType(m.KVDType); err != nil {
		return fmt.Errorf("memory.kv_dtype: %w", err)
	}
	if m.CPUThreads != "" {
		if n, err := strconv.Atoi(strings.TrimSpace(m.CPUThreads)); err != nil || n < 0 {
			return fmt.Errorf("memory.cpu_threads: %q is not a thread count", m.CPUThreads)
		}
	}
	return nil
}
