/* SPDX-License-Identifier: Apache-2.0 */
/* MPI transport: executes schedules with nonblocking MPI on a communicator it duplicates. */
#ifndef MFSDP_TRANSPORT_MPI_H
#define MFSDP_TRANSPORT_MPI_H

#include <mpi.h>

#include "transport/transport.h"

/* Collective over comm (MPI_Comm_dup). */
mfsdp_status_t mfsdp_transport_mpi_create(MPI_Comm comm, mfsdp_transport_t **t_p);

/*
 * Owner arenas in shared memory. The arena's allocator (alloc/arena.h, mfsdp_arena_mem_t of
 * a host arena, arg the transport; one arena per transport): a POSIX shared-memory object,
 * its pages reserved up front, or, when that fails (a small /dev/shm), an anonymous mapping
 * with a warning.
 */
mfsdp_status_t mfsdp_transport_mpi_arena_alloc(void *t, size_t bytes, void **ptr_p);
void mfsdp_transport_mpi_arena_free(void *t, void *ptr);

/*
 * Collective over the transport's communicator, after the arena is allocated (or when this
 * rank has none): every rank maps the arenas of the other ranks of its node read-only
 * (MPI_Comm_split_type shared). On only where want is 1 and every rank's arena is shared, on
 * every rank alike; off is not an error. *peer_p: world entries, a node peer's arena or NULL
 * (every entry NULL, or *peer_p NULL, when off); valid until the transport is destroyed. While
 * on, a gather run whose mfsdp_xfer_t.peer_src is set copies the direct algorithm's runs from
 * there instead of receiving them and sends nothing to node peers: it waits for the owners it
 * copies from to reach the same gather, and an owner's quiesce waits for its node peers to
 * finish the gathers it finished (counters in a page after each arena; no barrier).
 */
mfsdp_status_t mfsdp_transport_mpi_share(mfsdp_transport_t *t, int want,
                                         const char *const **peer_p);

#endif /* MFSDP_TRANSPORT_MPI_H */
