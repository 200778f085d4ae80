/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The cost model for mfsdp's owner-segment collectives (docs/tuner.md, "Cost model").
 *
 * NCCL runs Broadcast and Reduce on rings only, so what is left to choose is the protocol
 * and the channel count. An op of b bytes gets c channels (one per CHANNEL_BYTES, up to
 * what fills the GPU's link, divided by P = numPipeOps: NCCL's count of ops per channel
 * in the group, which share those channels). Each protocol then costs the ring's latency
 * plus b over the protocol's share of min(c channels, the link); the cheapest wins. A
 * channel carrying P ops pays P times both terms, so P changes the choice only via c.
 */
#include <stddef.h>
#include <stdint.h>

#include "plugin/tuner.h"

/* A channel is given to an op for every CHANNEL_BYTES it moves: at 20 GB/s per channel,
 * 512 KiB takes about 26 us, two to three times a ring's fixed latency below, so a
 * channel added below that size saves less time than the SM it takes from the compute
 * that the owner collectives overlap with. */
#define TUNER_CHANNEL_BYTES ((size_t)512 << 10)

/* Latencies in microseconds, NCCL's published ring defaults (src/graph/tuning.cc,
 * v2.28.9): a fixed cost per op, plus one hop per link the pipeline crosses. */
static const double base_us[NCCL_NUM_PROTOCOLS] = {6.6, 14.0, 8.4};
static const double hop_nvlink_us[NCCL_NUM_PROTOCOLS] = {0.6, 1.9, 3.4};
static const double hop_net_us[NCCL_NUM_PROTOCOLS] = {2.7, 4.0, 14.0};
/* Payload share of the wire: LL sends a 4-byte flag with every 4 data bytes, LL128 one
 * 8-byte flag per 128-byte line (NCCL uses 0.92), Simple sends data only. */
static const double efficiency[NCCL_NUM_PROTOCOLS] = {0.5, 0.92, 1.0};
/* Bandwidths in bytes per microsecond (= MB/s). One channel (one SM driving one ring)
 * moves 20 GB/s, NCCL's per-channel LL128 ring cap for Ampere; the GPU's way out caps the
 * sum: 320 GB/s of NVLink inside a node, one 400 Gb/s NIC (50 GB/s) across nodes. More
 * channels than fill that link (16, resp. 3) are never asked for. */
#define TUNER_BW_CHANNEL 20000.0
#define TUNER_BW_NVLINK  320000.0
#define TUNER_BW_NIC     50000.0

static size_t div_up(size_t a, size_t b)
{
    return a / b + (a % b != 0);
}

void mfsdp_tuner_model(size_t nbytes, int pipe_ops, size_t nranks, size_t nnodes,
                       mfsdp_tuner_choice_t *choice_p)
{
    size_t p_ops = pipe_ops > 1 ? (size_t)pipe_ops : 1;
    size_t nodes = nnodes >= 1 ? nnodes : 1;
    size_t ranks = nranks >= nodes ? nranks : nodes;

    double link = nodes > 1 ? TUNER_BW_NIC : TUNER_BW_NVLINK;
    size_t fill = (size_t)(link / TUNER_BW_CHANNEL);
    if ((double)fill * TUNER_BW_CHANNEL < link) {
        fill++;
    }
    size_t channels = div_up(nbytes, TUNER_CHANNEL_BYTES);
    if (channels < 1) {
        channels = 1;
    }
    if (channels > fill) {
        channels = fill;
    }
    /* P ops already share every channel: each op's share is 1/P of what it would take. */
    channels = div_up(channels, p_ops);

    /* The pipeline from the root crosses ranks-1 links; with the ranks of a node
     * adjacent on the ring, nodes-1 of them are network links. */
    double inter_hops = (double)(nodes - 1);
    double intra_hops = (double)(ranks - nodes);
    double bw = (double)channels * TUNER_BW_CHANNEL;
    if (bw > link) {
        bw = link;
    }

    int best = NCCL_PROTO_LL;
    double best_us = 0.0;
    for (int p = 0; p < NCCL_NUM_PROTOCOLS; p++) {
        double us = base_us[p] + intra_hops * hop_nvlink_us[p] + inter_hops * hop_net_us[p] +
                    (double)nbytes / (efficiency[p] * bw);
        if (p == 0 || us < best_us) {
            best = p;
            best_us = us;
        }
    }
    choice_p->proto = best;
    choice_p->channels = (int)channels;
}
