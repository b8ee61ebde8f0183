package cuda

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// memoryOp matches a PTX instruction that reads or writes memory other
// than the kernel's parameters and shared memory.
var memoryOp = regexp.MustCompile(`^\s*(?:@!?%p\d+\s+)?(?:ld|st|atom|red|cp\.async)\.(?:global\.|volatile\.global|relaxed|acquire|release|[a-z0-9]+\s)`)

// TestStepKernelsPDL checks, without a GPU, the committed PTX of the decode
// step's kernels (stepKernels): each is in a module for compute 7.0, its
// twin (pdlSuffix) in a module for 9.0 whose every kernel is such a twin,
// and the twin's first access to memory other than its parameters comes
// after griddepcontrol.launch_dependents and griddepcontrol.wait, so that
// it neither reads what the kernel before it writes nor writes what that
// kernel reads before that kernel is done.
func TestStepKernelsPDL(t *testing.T) {
	files, err := filepath.Glob("kernels/*.ptx")
	if err != nil || len(files) == 0 {
		t.Fatalf("no kernels/*.ptx (%v)", err)
	}
	plain := map[string]bool{}
	twins := map[string]string{} // name -> the twin's body
	for _, f := range files {
		data, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		ptx := string(data)
		target := ptxTarget(ptx)
		pdlModule := strings.HasPrefix(filepath.Base(f), "step_pdl")
		if pdlModule && target != 90 {
			t.Errorf("%s: target %d, want 90 (griddepcontrol)", f, target)
		}
		for _, name := range ptxEntries(ptx) {
			if !pdlModule {
				plain[name] = true
				if strings.HasSuffix(name, pdlSuffix) && !strings.HasPrefix(name, "gemv") {
					t.Errorf("%s: kernel %s is named as a twin outside step_pdl*.ptx", f, name)
				}
				continue
			}
			base, ok := strings.CutSuffix(name, pdlSuffix)
			if !ok {
				t.Errorf("%s: kernel %s is not a %s twin", f, name, pdlSuffix)
				continue
			}
			twins[base] = entryBody(ptx, name)
		}
	}
	for _, name := range stepKernels {
		if !plain[name] {
			t.Errorf("step kernel %s is in no compute_70 module", name)
		}
		body, ok := twins[name]
		if !ok {
			t.Errorf("step kernel %s has no %s twin in step_pdl*.ptx", name, pdlSuffix)
			continue
		}
		trigger, wait := strings.Index(body, "griddepcontrol.launch_dependents"), strings.Index(body, "griddepcontrol.wait")
		if trigger < 0 || wait < 0 {
			t.Errorf("%s%s: launch_dependents at %d, wait at %d: want both", name, pdlSuffix, trigger, wait)
			continue
		}
		first := -1
		off := 0
		for _, line := range strings.SplitAfter(body, "\n") {
			if memoryOp.MatchString(line) && !strings.Contains(line, ".param") && !strings.Contains(line, ".shared") {
				first = off
				break
			}
			off += len(line)
		}
		if first >= 0 && (first < wait || first < trigger) {
			t.Errorf("%s%s: memory is accessed (%q) before griddepcontrol.wait", name, pdlSuffix, strings.TrimSpace(body[first:first+strings.Index(body[first:], "\n")]))
		}
	}
	for base := range twins {
		found := false
		for _, name := range stepKernels {
			found = found || name == base
		}
		if !found {
			t.Errorf("%s%s: a twin the backend never launches (not in stepKernels)", base, pdlSuffix)
		}
	}
}

// entryBody is the text of kernel name's entry in ptx, up to the next
// entry.
func entryBody(ptx, name string) string {
	i := strings.Index(ptx, ".entry "+name+"(")
	if i < 0 {
		return ""
	}
	rest := ptx[i+1:]
	if j := strings.Index(rest, ".entry "); j >= 0 {
		rest = rest[:j]
	}
	return rest
}

func TestFoldNamed(t *testing.T) {
	type fold struct {
		on   bool
		maxK int
	}
	for v, want := range map[string]fold{"": {true, foldMaxK}, "on": {true, foldMaxK}, "0": {false, foldMaxK}, "all": {true, gemvNormMaxK}} {
		on, k, err := foldNamed(v)
		if err != nil || (fold{on, k}) != want {
			t.Errorf("foldNamed(%q) = %v, %d, %v; want %v", v, on, k, err, want)
		}
	}
	if _, _, err := foldNamed("All"); err == nil || !strings.Contains(err.Error(), FoldEnv) || !strings.Contains(err.Error(), "all") {
		t.Errorf("foldNamed(All): error %v, want one naming %s and all", err, FoldEnv)
	}
}

func TestPDLNamed(t *testing.T) {
	for v, want := range map[string]bool{"": true, "1": true, "on": true, "0": false, "off": false} {
		got, err := pdlNamed(v)
		if err != nil || got != want {
			t.Errorf("pdlNamed(%q) = %v, %v; want %v", v, got, err, want)
		}
	}
	for _, v := range []string{"yes", "2", "ON "} {
		if _, err := pdlNamed(v); err == nil || !strings.Contains(err.Error(), PDLEnv) {
			t.Errorf("pdlNamed(%q): error %v, want one naming %s", v, err, PDLEnv)
		}
	}
}
