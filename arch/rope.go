package arch

import "math"

// InvFreq returns the rotary inverse frequencies, HeadDim/2 of them, computed
// in float32 as Hugging Face does, with llama3 rescaling applied when set.
func (c *Config) InvFreq() []float32 {
	half := c.HeadDim / 2
	inv := make([]float32, half)
	for i := range inv {
		exp := float32(2*i) / float32(c.HeadDim)
		inv[i] = float32(1 / math.Pow(c.RopeTheta, float64(exp)))
	}
	if s := c.RopeScaling; s != nil {
		old := float64(s.OriginalMaxPositions)
		lowWavelen := old / s.LowFreqFactor
		highWavelen := old / s.HighFreqFactor
		for i, f := range inv {
			wavelen := 2 * math.Pi / float64(f)
			switch {
			case wavelen < highWavelen: // high frequencies stay
			case wavelen > lowWavelen:
				inv[i] = float32(float64(f) / s.Factor)
			default:
				smooth := (old/wavelen - s.LowFreqFactor) / (s.HighFreqFactor - s.LowFreqFactor)
				inv[i] = float32((1-smooth)*float64(f)/s.Factor + smooth*float64(f))
			}
		}
	}
	return inv
}

// RopeTables returns the cos and sin tables [maxPos, HeadDim/2] in float32:
// the angle is float32(pos) * invFreq rounded to float32, as in Hugging Face.
func (c *Config) RopeTables(maxPos int) (cos, sin []float32) {
	inv := c.InvFreq()
	half := len(inv)
	cos = make([]float32, maxPos*half)
	sin = make([]float32, maxPos*half)
	for p := 0; p < maxPos; p++ {
		for i, f := range inv {
			a := float64(float32(p) * f)
			cos[p*half+i] = float32(math.Cos(a))
			sin[p*half+i] = float32(math.Sin(a))
		}
	}
	return cos, sin
}
