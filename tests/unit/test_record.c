/* SPDX-License-Identifier: Apache-2.0 */
/* mfsdp-record/1 I/O and the capped append the recorder uses (core/record.h). */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/record.h"

static mfsdp_call_sig_t sig(mfsdp_call_kind_t kind, size_t count, mfsdp_dtype_t dtype)
{
    return (mfsdp_call_sig_t){kind, count, dtype};
}

static void write_text(const char *path, const char *text)
{
    FILE *f = fopen(path, "w");
    cr_assert_not_null(f);
    fputs(text, f);
    fclose(f);
}

Test(record, append_write_load_roundtrip)
{
    mfsdp_record_t rec = {0};
    mfsdp_record_comm_t comms[2];
    memset(comms, 0, sizeof(comms));
    rec.comms = comms;
    rec.ncomms = 2;
    comms[0].size = 1;
    comms[1].size = 4;
    /* many iterations: 1000 calls, far beyond the first allocation */
    for (size_t i = 0; i < 1000; i++) {
        mfsdp_call_sig_t s = sig(i % 3 == 2 ? MFSDP_CALL_REDUCE_SCATTER : MFSDP_CALL_ALLGATHER,
                                 17 + i, i % 2 ? MFSDP_BFLOAT16 : MFSDP_FLOAT32);
        cr_assert_eq(mfsdp_record_comm_append(&comms[1], &s, i % 3 == 2 ? "avg" : NULL, 0),
                     MFSDP_OK);
    }
    cr_assert_eq(comms[1].ncalls, 1000);
    char path[] = "/tmp/mfsdp-record-XXXXXX";
    int fd = mkstemp(path);
    cr_assert_geq(fd, 0);
    FILE *f = fdopen(fd, "w");
    cr_assert_eq(mfsdp_record_write(&rec, f), MFSDP_OK);
    fclose(f);
    mfsdp_record_t *back = NULL;
    char err[512] = "";
    cr_assert_eq(mfsdp_record_load(path, err, sizeof(err), &back), MFSDP_OK, "%s", err);
    unlink(path);
    cr_assert_eq(back->ncomms, 2);
    cr_expect_eq(back->comms[0].size, 1);
    cr_expect_eq(back->comms[0].ncalls, 0);
    cr_assert_eq(back->comms[1].size, 4);
    cr_assert_eq(back->comms[1].ncalls, 1000);
    for (size_t i = 0; i < 1000; i++) {
        const mfsdp_record_call_t *a = &comms[1].calls[i], *b = &back->comms[1].calls[i];
        cr_assert_eq(a->sig.kind, b->sig.kind);
        cr_assert_eq(a->sig.count, b->sig.count);
        cr_assert_eq(a->sig.dtype, b->sig.dtype);
        cr_assert_str_eq(a->op, b->op);
    }
    cr_expect_str_eq(back->comms[1].calls[2].op, "avg");
    cr_expect_str_eq(back->comms[1].calls[0].op, "none");
    /* a loaded record can be appended to */
    mfsdp_call_sig_t s = sig(MFSDP_CALL_ALLGATHER, 5, MFSDP_FLOAT16);
    cr_expect_eq(mfsdp_record_comm_append(&back->comms[1], &s, "none", 0), MFSDP_OK);
    cr_expect_eq(back->comms[1].calls[1000].sig.count, 5);
    mfsdp_record_free(back);
    free(comms[1].calls);
}

Test(record, append_stops_at_the_cap)
{
    mfsdp_record_comm_t rc = {0};
    mfsdp_call_sig_t s = sig(MFSDP_CALL_ALLGATHER, 3, MFSDP_FLOAT32);
    for (int i = 0; i < 70; i++) {
        cr_assert_eq(mfsdp_record_comm_append(&rc, &s, "none", 70), MFSDP_OK);
    }
    cr_expect_eq(mfsdp_record_comm_append(&rc, &s, "none", 70), MFSDP_ERR_OVERFLOW);
    cr_expect_eq(rc.ncalls, 70);
    cr_expect_leq(rc.capacity, 70, "never allocates past the cap");
    cr_expect_eq(mfsdp_record_comm_append(NULL, &s, "none", 70), MFSDP_ERR_INVALID_ARG);
    free(rc.calls);
}

Test(record, load_errors_name_the_path)
{
    char path[] = "/tmp/mfsdp-record-XXXXXX";
    int fd = mkstemp(path);
    cr_assert_geq(fd, 0);
    close(fd);
    mfsdp_record_t *rec = NULL;
    char err[512] = "";
    write_text(path, "{\"format\": \"mfsdp-record/1\", \"comms\": [{\"size\": 2, \"calls\": "
                     "[[\"allgather\", 5, \"float64\", \"none\"]]}]}");
    cr_expect_eq(mfsdp_record_load(path, err, sizeof(err), &rec), MFSDP_ERR_PARSE);
    cr_expect(strstr(err, "comms[0].calls[0][2]") != NULL, "%s", err);
    write_text(path, "{\"format\": \"mfsdp-record/1\", \"comms\": [{\"size\": 2, \"calls\": "
                     "[[\"allgather\", 5, \"float32\", \"none\"], [\"broadcast\", 5, "
                     "\"float32\", \"none\"]]}]}");
    cr_expect_eq(mfsdp_record_load(path, err, sizeof(err), &rec), MFSDP_ERR_PARSE);
    cr_expect(strstr(err, "comms[0].calls[1][0]") != NULL, "%s", err);
    write_text(path, "{\"format\": \"mfsdp-record/1\", \"comms\": [{\"size\": 0, \"calls\": []}]}");
    cr_expect_eq(mfsdp_record_load(path, err, sizeof(err), &rec), MFSDP_ERR_PARSE);
    cr_expect(strstr(err, "comms[0]") != NULL, "%s", err);
    write_text(path, "{\"format\": \"mfsdp-record/1\", \"comms\": [{\"size\": 2, \"calls\": "
                     "[[\"allgather\", -5, \"float32\", \"none\"]]}]}");
    cr_expect_eq(mfsdp_record_load(path, err, sizeof(err), &rec), MFSDP_ERR_PARSE);
    cr_expect(strstr(err, "comms[0].calls[0]") != NULL, "%s", err);
    write_text(path, "{\"format\": \"other\"}");
    cr_expect_eq(mfsdp_record_load(path, err, sizeof(err), &rec), MFSDP_ERR_PARSE);
    cr_expect(strstr(err, "format") != NULL, "%s", err);
    write_text(path, "{\"format\": \"mfsdp-record/1\", \"comms\": ");
    cr_expect_eq(mfsdp_record_load(path, err, sizeof(err), &rec), MFSDP_ERR_PARSE);
    cr_expect(strstr(err, path) != NULL, "%s", err);
    unlink(path);
    cr_expect_eq(mfsdp_record_load("/nonexistent/rec.json", err, sizeof(err), &rec), MFSDP_ERR_IO);
    cr_expect_null(rec);
}
