package cuda

import (
	"context"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"
)

// TestQuantSASS counts the instructions a weight costs in each quantized
// GEMV's unit, in the SASS ptxas writes for sm_90 (the H200) from
// testdata/quantprobe.cu: one lane's unit of the F32-x dot (quant.cuh, 4
// rows of w) and of the integer dot (quantx.cuh, the rows its kernel for
// one row of x takes), each in a kernel of its own. The unit's two-trip
// loops (#pragma unroll 1) count twice. The probe's own loads of its
// arguments and stores of the sums count too (some 20 instructions a
// kernel). It logs both counts and the dp2a instructions a weight, and
// checks that the integer unit costs fewer instructions a weight than the
// F32-x one for every format.
func TestQuantSASS(t *testing.T) {
	nvcc, err := exec.LookPath("nvcc")
	if err != nil {
		t.Skipf("nvcc not found: %v", err)
	}
	cuobjdump, err := exec.LookPath("cuobjdump")
	if err != nil {
		t.Skipf("cuobjdump not found: %v", err)
	}
	if testing.Short() {
		t.Skip("compiles the probe kernels with nvcc")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	cubin := filepath.Join(t.TempDir(), "quantprobe.cubin")
	if out, err := exec.CommandContext(ctx, nvcc, "-arch=sm_90", "-cubin", "-O3", "-o", cubin, "testdata/quantprobe.cu").CombinedOutput(); err != nil {
		t.Fatalf("nvcc: %v\n%s", err, out)
	}
	out, err := exec.CommandContext(ctx, cuobjdump, "-sass", cubin).Output()
	if err != nil {
		t.Fatalf("cuobjdump: %v", err)
	}
	counts := sassCounts(t, string(out))
	for _, f := range quantFormats {
		uq := 32
		if f.dt.BlockSize() == 256 {
			uq = 64
		}
		old, ok1 := counts["f32_"+f.name+"_r"+strconv.Itoa(uq)]
		cur, ok2 := counts["x16_"+f.name+"_r"+strconv.Itoa(uq)]
		if !ok1 || !ok2 {
			t.Errorf("%v: the probe has no kernels f32_%s_r%d and x16_%s_r%d", f.dt, f.name, uq, f.name, uq)
			continue
		}
		wOld, wCur := float64(4*uq), float64(f.xrows1*uq)
		t.Logf("%v: F32-x unit %.2f instructions a weight (4 rows of %d), integer unit %.2f (%d rows of %d; dp2a %.2f a weight)",
			f.dt, float64(old.total)/wOld, uq, float64(cur.total)/wCur, f.xrows1, uq, float64(cur.idp)/wCur)
		if float64(cur.total)/wCur >= float64(old.total)/wOld {
			t.Errorf("%v: the integer unit costs %.2f instructions a weight, the F32-x one %.2f", f.dt, float64(cur.total)/wCur, float64(old.total)/wOld)
		}
	}
}

type sassCount struct{ total, idp int }

var (
	sassInstr = regexp.MustCompile(`^\s*/\*([0-9a-f]{4,})\*/\s+([^;]*);`)
	sassBra   = regexp.MustCompile(`\bBRA\s+(?:\S+\s+)?0x([0-9a-f]+)`)
)

// sassCounts returns the instructions of each function of cuobjdump's
// listing, less NOPs, EXIT and the closing self-branch, with the body of a
// backward branch's loop counted once more.
func sassCounts(t *testing.T, sass string) map[string]sassCount {
	t.Helper()
	res := map[string]sassCount{}
	for _, fn := range strings.Split(sass, "Function : ")[1:] {
		name := strings.TrimSpace(strings.SplitN(fn, "\n", 2)[0])
		type ins struct {
			addr int64
			text string
		}
		var list []ins
		for _, line := range strings.Split(fn, "\n") {
			m := sassInstr.FindStringSubmatch(line)
			if m == nil {
				continue
			}
			a, _ := strconv.ParseInt(m[1], 16, 64)
			list = append(list, ins{a, strings.TrimSpace(m[2])})
		}
		var c sassCount
		loops := 0
		for _, in := range list {
			op := strings.Fields(in.text)[0]
			if strings.HasPrefix(op, "@") {
				op = strings.Fields(in.text)[1]
			}
			if op == "NOP" || op == "EXIT" {
				continue
			}
			if m := sassBra.FindStringSubmatch(in.text); m != nil {
				tgt, _ := strconv.ParseInt(m[1], 16, 64)
				if tgt == in.addr {
					continue // the closing self-branch
				}
				if tgt < in.addr {
					loops++
					for _, b := range list {
						if b.addr >= tgt && b.addr <= in.addr {
							c.total++
							if strings.Contains(b.text, "IDP") {
								c.idp++
							}
						}
					}
				}
			}
			c.total++
			if strings.HasPrefix(op, "IDP") {
				c.idp++
			}
		}
		if loops > 1 {
			t.Errorf("%s: %d loops; the count assumes at most one, of two trips", name, loops)
		}
		res[name] = c
	}
	return res
}
