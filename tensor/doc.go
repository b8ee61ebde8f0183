// Package tensor is the contract between the code that computes (nn) or
// moves weights (paging) and the devices it runs on, with the one device
// every machine has: the pure-Go CPU backend.
//
// What it owns:
//
//   - Tensor, DType and Shape: a dense row-major array of one element type
//     (F32, F16, BF16, I32, I64) in host memory or in memory a backend
//     owns; Rows, Reshape and View are windows over another's storage.
//   - Backend, cut in two. Memory (Name, Alloc, Free, Upload, Download,
//     Close) holds tensors and copies bytes; it is all package paging
//     depends on. Kernels are the decoder's operations (MatMul, RMSNorm,
//     Rope, SiLUMul, Add, Embed, CopyRows, Attention); the fused ones take
//     small argument structs (Rotary, Attn). GradOps are their backward,
//     for training. Activations are F32; weights are read in their stored
//     type, never copied to F32.
//   - The rules of every operation's arguments (dtypes, shapes, ranges,
//     which operands may share storage), written once in check.go and run
//     by Checked, the front through which code computes. A backend's
//     kernels check only what their own memory safety needs: that the
//     operands are their memory, and the limits of their kernels.
//   - Optional capabilities, each a small interface with one helper that
//     finds it, behind a Checked front too: Sync (Syncer), Pinned
//     (PinnedAllocator), AsyncUpload (AsyncUploader), StagedUpload
//     (StagedUploader: copies the host can wait for), AsyncDownload
//     (AsyncDownloader: copies to the host it need not wait for), Managed
//     (ManagedAllocator), FreeMemory (MemoryInfo), CopyStats (CopyTimer),
//     Caching (CachingAllocator), and CheckedGrad for GradOps.
//   - The registry of device drivers: a device package registers its
//     Driver from init (RegisterDriver), a program links it in with a blank
//     import, and code opens devices by name: OpenDevice("cpu"),
//     OpenDevice("cuda:1"), OpenDevice("auto"); Devices lists them.
//   - The CPU backend (NewCPU, the "cpu" driver): a persistent pool of
//     goroutines per backend, AVX2 or AVX-512 kernels chosen at run time
//     with a portable Go fallback; decoding one token is bound by the bytes
//     of weights read per second.
//
// What it must not know: models, layers, budgets or placement (packages
// nn and paging); any device but the CPU, which its packages implement and
// register (nothing here names them); exchange formats of other libraries
// (package tensor/gorgonia).
//
// Example:
//
//	b, err := tensor.OpenDevice("auto", tensor.DeviceOptions{}) // a linked-in GPU that opens, else the CPU
//	if err != nil {
//		return err
//	}
//	defer b.Close()
//	k := tensor.Checked(b) // each call's arguments checked before the kernel runs
//	x, _ := b.Alloc(tensor.F32, tensor.Shape{1, 4096})
//	out, _ := b.Alloc(tensor.F32, tensor.Shape{1, 4096})
//	if err := b.Upload(x, 0, hidden); err != nil { // hidden: 16 KiB of little-endian F32
//		return err
//	}
//	if err := k.MatMul(out, x, qProj, nil); err != nil { // qProj: F16 [4096, 4096] on b
//		return err // e.g. tensor: MatMul: w has shape [4096, 11008], want dimension 1 = 4096
//	}
//	return tensor.Sync(b)
//
// Package tensortest checks any Backend against float64 references.
package tensor
