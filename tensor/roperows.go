package tensor

import "fmt"

// RowRoper is a backend that rotates rows each at a position of its own in
// one operation (RopeRows): a batched step's rows, each sequence's at its
// own positions, in one call where Rope takes a run of consecutive
// positions. Call it through RopeRows, which checks the arguments.
type RowRoper interface {
	RopeRows(x *Tensor, r Rotary, pos []int32) error
}

// RopeRows rotates each row t of x as Rope does at position pos[t], the
// bits of Rope's (r.Pos0 is not used and r.PosAt must be nil): with b's
// RopeRows when b is a RowRoper, else with one Rope for each run of rows
// at consecutive positions.
func RopeRows(b Backend, x *Tensor, r Rotary, pos []int32) error {
	if err := checkRopeRows(x, r, pos); err != nil {
		return err
	}
	if rr, ok := capability[RowRoper](b); ok {
		return rr.RopeRows(x, r, pos)
	}
	r.PosAt = nil
	for t := 0; t < len(pos); {
		n := 1
		for t+n < len(pos) && pos[t+n] == pos[t]+int32(n) {
			n++
		}
		rows, err := x.Rows(t, n)
		if err != nil {
			return err
		}
		r.Pos0 = int(pos[t])
		if err := b.Rope(rows, r); err != nil {
			return err
		}
		t += n
	}
	return nil
}

// checkRopeRows checks RopeRows' arguments as checkRope checks Rope's, with
// a position of the tables for each row of x.
func checkRopeRows(x *Tensor, r Rotary, pos []int32) error {
	const op = "RopeRows"
	if r.PosAt != nil {
		return fmt.Errorf("tensor: %s: PosAt is set; the rows' positions are pos", op)
	}
	// Not checkRope: its positions are Pos0 onwards, one a row; a
	// batched step may have more rows than the tables have positions.
	r.Pos0 = 0
	if err := checkRotary(op, x, r); err != nil {
		return err
	}
	if t := x.shape[0]; len(pos) != t {
		return fmt.Errorf("tensor: %s: %d positions for %d rows", op, len(pos), t)
	}
	maxPos := r.Cos.shape[0]
	for t, p := range pos {
		if p < 0 || int(p) >= maxPos {
			return fmt.Errorf("tensor: %s: row %d at position %d, outside the %d-position tables", op, t, p, maxPos)
		}
	}
	return nil
}
