/* SPDX-License-Identifier: Apache-2.0 */
/* MPI transport: executes schedules with nonblocking MPI on a communicator it duplicates. */
#ifndef MFSDP_TRANSPORT_MPI_H
#define MFSDP_TRANSPORT_MPI_H

#include <mpi.h>

#include "transport/transport.h"

/* Collective over comm (MPI_Comm_dup). */
mfsdp_status_t mfsdp_transport_mpi_create(MPI_Comm comm, mfsdp_transport_t **t_p);

#endif /* MFSDP_TRANSPORT_MPI_H */
