/* SPDX-License-Identifier: Apache-2.0 */
/* The shim core's operations on an MPI communicator (ld_preload/mpi_ops.c). */
#ifndef MFSDP_LD_PRELOAD_MPI_OPS_H
#define MFSDP_LD_PRELOAD_MPI_OPS_H

#include <mpi.h>

#include "ld_preload/shim.h"

extern const shim_fe_ops_t shim_mpi_ops;
/* Front-end state for comm (owns: the shim made it and frees it at release). */
void *shim_mpi_state(MPI_Comm comm, int owns);
MPI_Comm shim_mpi_comm(const shim_comm_t *c);

#endif /* MFSDP_LD_PRELOAD_MPI_OPS_H */
