package nn

// The backward operations themselves are the backend's (tensor.GradOps);
// what stays here runs on the host.

// embedBack adds each row of dx [T, H] into row ids[t] of dtable.
func embedBack(dtable, dx []float32, ids []int32, H int) {
	for t, id := range ids {
		row := dtable[int(id)*H : (int(id)+1)*H]
		for i, v := range dx[t*H : (t+1)*H] {
			row[i] += v
		}
	}
}
