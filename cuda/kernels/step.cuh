// Programmatic dependent launch (compute capability 9.0) for the small
// kernels of a decode step: the norms, rope_kv, the split attention and
// its merge, the residual add. Each is compiled twice: into its own module
// for compute_70, and with STEP_PDL defined into a step_pdl*.cu module for
// compute_90, where STEP_KERNEL(name) names it name_pdl and step_begin(),
// its first statement, lets the next kernel launch at once (its blocks
// take the room this grid leaves and wait there) and then waits for the
// kernel before this one to complete with its writes visible. Every thread
// waits before it reads or writes anything, so the grid completes after
// the one before it, and so after every one before that; the backend
// launches these twins with programmatic stream serialization
// (Backend.runStep). Elsewhere both macros are plain.
#pragma once

#ifdef STEP_PDL
#define STEP_KERNEL(name) name##_pdl
#define step_begin() asm volatile("griddepcontrol.launch_dependents;\n\tgriddepcontrol.wait;" ::: "memory")
#else
#define STEP_KERNEL(name) name
#define step_begin() ((void)0)
#endif
