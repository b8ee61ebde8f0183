package cuda

import (
	"crypto/sha256"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"testing"
)

// sourcesHash is the hash genptx.sh records: sha256 over the lines
// "<sha256 of file>  <name>\n" of kernels/*.cu and kernels/*.cuh in byte
// order of their names (what `ls | sort | xargs sha256sum | sha256sum`
// prints in LC_ALL=C).
func sourcesHash(dir string) (string, []string, error) {
	var names []string
	for _, pat := range []string{"*.cu", "*.cuh"} {
		m, err := filepath.Glob(filepath.Join(dir, pat))
		if err != nil {
			return "", nil, err
		}
		for _, p := range m {
			names = append(names, filepath.Base(p))
		}
	}
	sort.Strings(names)
	var list strings.Builder
	for _, n := range names {
		data, err := os.ReadFile(filepath.Join(dir, n))
		if err != nil {
			return "", nil, err
		}
		fmt.Fprintf(&list, "%x  %s\n", sha256.Sum256(data), n)
	}
	return fmt.Sprintf("%x", sha256.Sum256([]byte(list.String()))), names, nil
}

var generatedRE = regexp.MustCompile(`^// Code generated .* DO NOT EDIT\.$`)

// TestPTXUpToDate checks, without nvcc, that the committed PTX was made by
// make cuda-ptx from the current kernel sources.
func TestPTXUpToDate(t *testing.T) {
	want, names, err := sourcesHash("kernels")
	if err != nil {
		t.Fatal(err)
	}
	var sources []string
	for _, n := range names {
		if strings.HasSuffix(n, ".cu") {
			sources = append(sources, n)
		}
	}
	if len(sources) == 0 {
		t.Fatal("no kernels/*.cu")
	}
	ptxs, _ := filepath.Glob("kernels/*.ptx")
	if len(ptxs) != len(sources) {
		t.Errorf("%d PTX files for %d .cu sources; run make cuda-ptx", len(ptxs), len(sources))
	}
	for _, src := range sources {
		file := filepath.Join("kernels", strings.TrimSuffix(src, ".cu")+".ptx")
		data, err := os.ReadFile(file)
		if err != nil {
			t.Errorf("%s: %v; run make cuda-ptx", file, err)
			continue
		}
		lines := strings.SplitN(string(data), "\n", 4)
		if len(lines) < 4 || !generatedRE.MatchString(lines[0]) {
			t.Errorf("%s: first line %q is not a generated-code header", file, lines[0])
			continue
		}
		got := strings.TrimPrefix(lines[1], "// sources-sha256: ")
		if got != want {
			t.Errorf("%s was generated from other sources (hash %s, sources now %s); run make cuda-ptx", file, got, want)
		}
		isa, need, err := ptxNeeds(string(data))
		if err != nil {
			t.Errorf("%s: %v", file, err)
			continue
		}
		// A source may ask for a newer target (genptx-arch); every other
		// module must load on compute capability 7.0.
		want := 70
		if src, err := os.ReadFile(filepath.Join("kernels", src)); err == nil {
			if m := regexp.MustCompile(`(?m)^// genptx-arch: compute_(\d+)`).FindSubmatch(src); m != nil {
				want, _ = strconv.Atoi(string(m[1]))
			}
		}
		if got := ptxTarget(string(data)); got == 0 || got > want {
			t.Errorf("%s: target sm_%d, want sm_%d or lower; build with make cuda-ptx", file, got, want)
		}
		t.Logf("%s: PTX ISA %s, needs a driver for CUDA %s+ (%s)", file, isa, versionString(need), strings.TrimPrefix(lines[2], "// "))
	}
}

func TestPTXTarget(t *testing.T) {
	for _, c := range []struct {
		ptx  string
		want int
	}{
		{"//\n.version 7.8\n.target sm_70\n", 70},
		{".version 7.8\n.target sm_80\n.address_size 64\n", 80},
		{".version 7.8\n", 0},
	} {
		if got := ptxTarget(c.ptx); got != c.want {
			t.Errorf("ptxTarget(%q) = %d, want %d", c.ptx, got, c.want)
		}
	}
	// The tensor-core kernels' modules target 8.0; the rest 7.0.
	data, err := os.ReadFile("kernels/flash_attention_f16.ptx")
	if err != nil {
		t.Fatal(err)
	}
	if got := ptxTarget(string(data)); got != 80 {
		t.Errorf("flash_attention_f16.ptx targets sm_%d, want sm_80", got)
	}
}

func TestPTXNeeds(t *testing.T) {
	for _, c := range []struct {
		ptx  string
		isa  string
		need int
	}{
		{"//\n.version 7.8\n.target sm_70\n", "7.8", 11080},
		{".version 7.0\n", "7.0", 11000},
		{"\t.version 8.0\n", "8.0", 12000},
		{".version 8.5\n", "8.5", 12050},
		{".version 8.7\n", "8.7", 12080},
		{".version 9.0\n", "9.0", 13000},
	} {
		isa, need, err := ptxNeeds(c.ptx)
		if err != nil || isa != c.isa || need != c.need {
			t.Errorf("ptxNeeds(%q) = %q, %d, %v; want %q, %d", c.ptx, isa, need, err, c.isa, c.need)
		}
	}
	if _, _, err := ptxNeeds(".target sm_70\n"); err == nil {
		t.Error("PTX without .version: no error")
	}
	if got := versionString(11080); got != "11.8" {
		t.Errorf("versionString(11080) = %q", got)
	}
}
