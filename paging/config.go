package paging

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"

	"go.yaml.in/yaml/v3"
)

// MemoryMode says how weights reach the device.
type MemoryMode string

// The memory modes.
const (
	// ModeExplicit copies layers into device memory under the budget.
	ModeExplicit MemoryMode = "explicit"
	// ModeUnified uses managed memory with prefetch hints.
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
// for ParseSize ("3.5GiB", "800MiB", a bare number is GiB); empty fields are
// unset, and the CLI's flags override what is set.
type MemoryConfig struct {
	OffloadStrategy   string  `yaml:"offload_strategy"`
	MaxGPUMemory      string  `yaml:"max_gpu_memory"`
	MaxHostMemory     string  `yaml:"max_host_memory"`
	MemoryMode        string  `yaml:"memory_mode"`
	GPUMemoryFraction float64 `yaml:"gpu_memory_fraction"`
}

// FileConfig is a strata YAML config file.
type FileConfig struct {
	Memory MemoryConfig `yaml:"memory"`
}

// LoadConfigFile reads a YAML config file and checks its memory section:
// unknown keys, unparsable sizes, strategies or modes are errors naming the
// file.
func LoadConfigFile(path string) (*FileConfig, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("paging: config: %w", err)
	}
	// Other sections belong to other packages; the memory section is
	// decoded strictly, so a misspelt key is an error, not a silent default.
	var top struct {
		Memory yaml.Node `yaml:"memory"`
	}
	if err := yaml.Unmarshal(data, &top); err != nil {
		return nil, fmt.Errorf("paging: config %s: %w", path, err)
	}
	var fc FileConfig
	if !top.Memory.IsZero() {
		section, err := yaml.Marshal(&top.Memory)
		if err != nil {
			return nil, fmt.Errorf("paging: config %s: memory: %w", path, err)
		}
		dec := yaml.NewDecoder(bytes.NewReader(section))
		dec.KnownFields(true)
		if err := dec.Decode(&fc.Memory); err != nil && !errors.Is(err, io.EOF) {
			return nil, fmt.Errorf("paging: config %s: memory: %w", path, err)
		}
	}
	if err := fc.Memory.Validate(); err != nil {
		return nil, fmt.Errorf("paging: config %s: %w", path, err)
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
		if _, err := ParseSize(m.MaxGPUMemory); err != nil {
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
	if m.GPUMemoryFraction != 0 && !(m.GPUMemoryFraction > 0 && m.GPUMemoryFraction <= 1) {
		return fmt.Errorf("memory.gpu_memory_fraction: %v is not in (0, 1]", m.GPUMemoryFraction)
	}
	return nil
}
