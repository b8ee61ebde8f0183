package cuda

import (
	"fmt"
	"regexp"
	"strconv"
	"strings"
)

var ptxVersionRE = regexp.MustCompile(`(?m)^\s*\.version\s+(\d+)\.(\d+)`)

// ptxNeeds reads the PTX ISA version of a PTX image and returns it with the
// oldest CUDA version whose driver accepts it, as cuDriverGetVersion
// numbers it (1000*major + 10*minor: PTX ISA 7.8 needs 11080, CUDA 11.8).
func ptxNeeds(ptx string) (isa string, cudaVersion int, err error) {
	m := ptxVersionRE.FindStringSubmatch(ptx)
	if m == nil {
		return "", 0, fmt.Errorf("no .version directive in the PTX")
	}
	major, _ := strconv.Atoi(m[1])
	minor, _ := strconv.Atoi(m[2])
	isa = m[1] + "." + m[2]
	switch {
	case major == 6 && minor >= 4: // 6.4 came with CUDA 10.1, 6.5 with 10.2
		return isa, 10000 + 10*(minor-3), nil
	case major == 7: // 7.x came with CUDA 11.x
		return isa, 11000 + 10*minor, nil
	case major == 8 && minor <= 5: // 8.0..8.5 came with CUDA 12.0..12.5
		return isa, 12000 + 10*minor, nil
	case major == 8: // 8.6 came with CUDA 12.7, 8.7 with 12.8, 8.8 with 12.9
		return isa, 12070 + 10*(minor-6), nil
	case major >= 9: // 9.0 came with CUDA 13.0
		return isa, 13000 + 1000*(major-9) + 10*minor, nil
	}
	return isa, 0, nil
}

// versionString formats a cuDriverGetVersion number as "major.minor".
func versionString(v int) string { return fmt.Sprintf("%d.%d", v/1000, v%1000/10) }

var ptxTargetRE = regexp.MustCompile(`(?m)^\.target sm_(\d+)`)

// ptxTarget returns the compute capability a PTX image targets, as
// 10*major + minor (".target sm_80" is 80), or 0 when it names none.
func ptxTarget(ptx string) int {
	m := ptxTargetRE.FindStringSubmatch(ptx)
	if m == nil {
		return 0
	}
	v, _ := strconv.Atoi(m[1])
	return v
}

// ptxEntries lists the kernels (.entry directives) of a PTX image.
func ptxEntries(ptx string) []string {
	var out []string
	for _, line := range strings.Split(ptx, "\n") {
		line = strings.TrimSpace(line)
		if !strings.HasPrefix(line, ".visible .entry ") && !strings.HasPrefix(line, ".entry ") {
			continue
		}
		name := line[strings.Index(line, ".entry ")+len(".entry "):]
		if i := strings.IndexAny(name, "( "); i >= 0 {
			name = name[:i]
		}
		out = append(out, name)
	}
	return out
}
