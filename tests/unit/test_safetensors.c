/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The safetensors reader and writer (core/safetensors.c): a round trip of every dtype,
 * scalars and empty tensors; the reference serializer's exact bytes; every way a hostile
 * header is refused (by status and by a message naming the file and the tensor); writer
 * argument errors; reads outside a tensor or past a truncated file.
 */
#include <criterion/criterion.h>
#include <criterion/parameterized.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/log.h"
#include "core/safetensors.h"

#define POISON ((mfsdp_st_header_t *)(uintptr_t)0x5a5a5a5a)

static void quiet(void)
{
    setenv("MFSDP_DEBUG", "NONE", 1);
    mfsdp_log_reinit();
}

static char g_dir[64];

static void setup(void)
{
    quiet();
    snprintf(g_dir, sizeof(g_dir), "/tmp/mfsdp-st-%d", (int)getpid());
    mkdir(g_dir, 0755);
}

static void teardown(void)
{
    char cmd[128];
    snprintf(cmd, sizeof(cmd), "rm -rf %s", g_dir);
    cr_assert_eq(system(cmd), 0);
}

/* A file image: 8-byte length, header text (' for "), then `data` bytes of value 0x11. */
static size_t image(unsigned char *out, size_t cap, const char *sq, size_t data)
{
    size_t n = strlen(sq);
    cr_assert_lt(8 + n + data, cap);
    for (int i = 0; i < 8; i++) {
        out[i] = (unsigned char)((uint64_t)n >> (8 * i));
    }
    for (size_t i = 0; i < n; i++) {
        out[8 + i] = sq[i] == '\'' ? '"' : (unsigned char)sq[i];
    }
    memset(out + 8 + n, 0x11, data);
    return 8 + n + data;
}

TestSuite(safetensors, .init = setup, .fini = teardown);

/* ---- round trip -------------------------------------------------------------------------- */

Test(safetensors, round_trip_every_dtype)
{
    enum { N = MFSDP_ST_DTYPE_COUNT + 2 };
    mfsdp_st_entry_t e[N];
    memset(e, 0, sizeof(e));
    char names[N][32];
    unsigned char *bufs[N];
    for (int i = 0; i < MFSDP_ST_DTYPE_COUNT; i++) {
        snprintf(names[i], sizeof(names[i]), "t.%s", mfsdp_st_dtype_name((mfsdp_st_dtype_t)i));
        e[i].name = names[i];
        e[i].dtype = (mfsdp_st_dtype_t)i;
        e[i].ndim = 2;
        e[i].shape[0] = 3;
        e[i].shape[1] = 1 + i % 4;
        e[i].bytes = (uint64_t)(3 * (1 + i % 4)) * mfsdp_st_dtype_size(e[i].dtype);
        bufs[i] = malloc(e[i].bytes);
        for (uint64_t b = 0; b < e[i].bytes; b++) {
            bufs[i][b] = (unsigned char)(b * 7 + (uint64_t)i);
        }
        e[i].data = bufs[i];
    }
    /* a scalar (shape []) and an empty tensor (a zero dim: no bytes) */
    float scalar = 2.5f;
    e[N - 2] = (mfsdp_st_entry_t){
        .name = "scalar", .dtype = MFSDP_ST_F32, .ndim = 0, .bytes = 4, .data = &scalar};
    bufs[N - 2] = NULL;
    e[N - 1] = (mfsdp_st_entry_t){.name = "empty",
                                  .dtype = MFSDP_ST_BF16,
                                  .ndim = 2,
                                  .shape = {0, 5},
                                  .bytes = 0,
                                  .data = NULL};
    bufs[N - 1] = NULL;
    const char *mk[] = {"format", "note"};
    const char *mv[] = {"pt", "caf\xc3\xa9 \"quoted\""};
    char path[128], hex[MFSDP_SHA256_HEX], fhex[MFSDP_SHA256_HEX];
    snprintf(path, sizeof(path), "%s/rt.safetensors", g_dir);
    uint64_t bytes = 0, fbytes = 0;
    cr_assert_eq(mfsdp_st_write(path, e, N, mk, mv, 2, NULL, hex, &bytes), MFSDP_OK);
    struct stat sb;
    char tmp[160];
    snprintf(tmp, sizeof(tmp), "%s.tmp", path);
    cr_assert_neq(stat(tmp, &sb), 0, "the temporary file must be gone");
    cr_assert_eq(mfsdp_sha256_file(path, fhex, &fbytes), MFSDP_OK);
    cr_assert_str_eq(hex, fhex, "the digest covers exactly the bytes written");
    cr_assert_eq(bytes, fbytes);

    mfsdp_st_file_t *f = NULL;
    char err[512] = "";
    cr_assert_eq(mfsdp_st_open(path, err, sizeof(err), &f), MFSDP_OK, "%s", err);
    cr_assert_eq(f->hdr->header_len % 8, 0, "header padded to 8 bytes");
    cr_assert_eq(f->hdr->ntensors, (size_t)N);
    cr_assert_str_eq(mfsdp_st_meta(f->hdr, "format"), "pt");
    cr_assert_str_eq(mfsdp_st_meta(f->hdr, "note"), mv[1]);
    cr_assert_null(mfsdp_st_meta(f->hdr, "absent"));
    for (int i = 0; i < N; i++) {
        const mfsdp_st_tensor_t *t = mfsdp_st_find(f->hdr, e[i].name);
        cr_assert_not_null(t, "%s", e[i].name);
        cr_assert_eq(t->dtype, e[i].dtype);
        cr_assert_eq(t->ndim, e[i].ndim);
        for (int d = 0; d < t->ndim; d++) {
            cr_assert_eq(t->shape[d], e[i].shape[d]);
        }
        cr_assert_eq(t->end - t->begin, e[i].bytes);
        cr_assert_eq((f->hdr->data_start + t->begin) % 8 == 0 || i > 0, 1);
        unsigned char *back = malloc(e[i].bytes + 1);
        cr_assert_eq(mfsdp_st_read(f, t, 0, e[i].bytes, back, NULL, 0), MFSDP_OK);
        cr_assert(e[i].bytes == 0 || memcmp(back, e[i].data, e[i].bytes) == 0, "%s", e[i].name);
        free(back);
    }
    cr_assert_null(mfsdp_st_find(f->hdr, "nope"));
    /* the buffer starts 8-byte aligned: the first tensor can be cast in place */
    cr_assert_eq(f->hdr->data_start % 8, 0);
    /* reads outside a tensor are refused */
    const mfsdp_st_tensor_t *t0 = mfsdp_st_find(f->hdr, e[0].name);
    unsigned char b[64];
    cr_assert_eq(mfsdp_st_read(f, t0, e[0].bytes - 1, 2, b, err, sizeof(err)),
                 MFSDP_ERR_INVALID_ARG);
    cr_assert(strstr(err, "outside its") != NULL, "%s", err);
    mfsdp_st_close(f);
    for (int i = 0; i < N; i++) {
        free(bufs[i]);
    }
}

/* Bytes the reference serializer produces for {"attn.0": F32 [1, 2, 3] = 0..5} (the test
 * "test_serialization" of huggingface/safetensors): our parser reads them and our writer
 * reproduces them exactly. */
Test(safetensors, reference_bytes)
{
    static const char hdr[] =
        "{\"attn.0\":{\"dtype\":\"F32\",\"shape\":[1,2,3],\"data_offsets\":[0,24]}}";
    unsigned char file[256];
    size_t n = strlen(hdr); /* 62, padded to 64 */
    size_t padded = (n + 7) & ~(size_t)7;
    memset(file, 0, sizeof(file));
    file[0] = (unsigned char)padded;
    memcpy(file + 8, hdr, n);
    memset(file + 8 + n, ' ', padded - n);
    float vals[6] = {0, 1, 2, 3, 4, 5};
    memcpy(file + 8 + padded, vals, sizeof(vals));
    size_t size = 8 + padded + sizeof(vals);
    cr_assert_eq(padded, 64);
    mfsdp_st_header_t *h = NULL;
    cr_assert_eq(mfsdp_st_parse_buffer(file, size, "ref", NULL, 0, &h), MFSDP_OK);
    cr_assert_eq(h->ntensors, 1);
    cr_assert_eq(h->data_start, 72);
    mfsdp_st_header_free(h);

    mfsdp_st_entry_t e = {.name = "attn.0",
                          .dtype = MFSDP_ST_F32,
                          .ndim = 3,
                          .shape = {1, 2, 3},
                          .bytes = 24,
                          .data = vals};
    char path[128], hex[MFSDP_SHA256_HEX];
    snprintf(path, sizeof(path), "%s/ref.safetensors", g_dir);
    cr_assert_eq(mfsdp_st_write(path, &e, 1, NULL, NULL, 0, NULL, hex, NULL), MFSDP_OK);
    FILE *fp = fopen(path, "rb");
    unsigned char back[256];
    size_t got = fread(back, 1, sizeof(back), fp);
    fclose(fp);
    cr_assert_eq(got, size);
    cr_assert_eq(memcmp(back, file, size), 0, "writer output differs from the reference bytes");
}

/* ---- hostile headers --------------------------------------------------------------------- */

typedef struct bad_hdr {
    char hdr[240]; /* ' for " */
    int data;      /* bytes of data after the header */
    int status;
    char expect[120];
} bad_hdr_t;

#define PARSE MFSDP_ERR_PARSE
#define T1    "'a':{'dtype':'F32','shape':[2],'data_offsets':[0,8]}"

ParameterizedTestParameters(safetensors, hostile)
{
    static bad_hdr_t cases[] = {
        {"[]", 0, PARSE, "does not start with '{'"},
        {" {}", 0, PARSE, "does not start with '{'"},
        {"{'a':", 0, PARSE, "not valid JSON"},
        {"{'a':1} x", 0, PARSE, "not valid JSON"},
        {"{'a':1,'a':2}", 0, PARSE, "duplicate"},
        {"{'a':'x'}", 0, PARSE, "tensor 'a': expected an object"},
        {"{'':{'dtype':'F32','shape':[],'data_offsets':[0,4]}}", 4, PARSE, "empty name"},
        {"{'a':{'dtype':'F33','shape':[2],'data_offsets':[0,8]}}", 8, PARSE,
         "tensor 'a': unknown dtype 'F33'"},
        {"{'a':{'dtype':3,'shape':[2],'data_offsets':[0,8]}}", 8, PARSE,
         "tensor 'a': dtype is not a string"},
        {"{'a':{'dtype':'F32','shape':[2],'data_offsets':[0,8],'x':1}}", 8, PARSE,
         "tensor 'a': unknown key 'x'"},
        {"{'a':{'dtype':'F32','shape':[2]}}", 8, PARSE, "tensor 'a': missing data_offsets"},
        {"{'a':{'shape':[2],'data_offsets':[0,8]}}", 8, PARSE, "tensor 'a': missing dtype"},
        {"{'a':{'dtype':'F32','shape':2,'data_offsets':[0,8]}}", 8, PARSE,
         "tensor 'a': shape must be an array"},
        {"{'a':{'dtype':'F32','shape':[-2],'data_offsets':[0,8]}}", 8, PARSE,
         "tensor 'a': shape[0] is not a non-negative integer"},
        {"{'a':{'dtype':'F32','shape':[2.0],'data_offsets':[0,8]}}", 8, PARSE,
         "tensor 'a': shape[0] is not"},
        {"{'a':{'dtype':'F32','shape':[1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1],'data_offsets':[0,4]}}",
         4, PARSE, "at most 16"},
        {"{'a':{'dtype':'F32','shape':[4294967296,4294967296],'data_offsets':[0,8]}}", 8, PARSE,
         "tensor 'a': shape x dtype size overflows"},
        {"{'a':{'dtype':'F32','shape':[2],'data_offsets':[0]}}", 8, PARSE,
         "tensor 'a': data_offsets must be [begin, end]"},
        {"{'a':{'dtype':'F32','shape':[2],'data_offsets':[-1,7]}}", 8, PARSE,
         "tensor 'a': data_offsets must be"},
        {"{'a':{'dtype':'F32','shape':[2],'data_offsets':[8,0]}}", 8, PARSE,
         "tensor 'a': data_offsets [8, 0] end before they begin"},
        {"{'a':{'dtype':'F32','shape':[3],'data_offsets':[0,8]}}", 8, PARSE,
         "tensor 'a': data_offsets [0, 8] hold 8 bytes but shape x F32 needs 12"},
        {"{" T1 ",'b':{'dtype':'F32','shape':[2],'data_offsets':[4,12]}}", 12, PARSE,
         "tensor 'b': data_offsets [4, 12] overlap tensor 'a' [0, 8]"},
        {"{" T1 ",'b':{'dtype':'F32','shape':[2],'data_offsets':[12,20]}}", 20, PARSE,
         "tensor 'b': data_offsets [12, 20] leave a hole of 4 bytes"},
        {"{'b':{'dtype':'F32','shape':[2],'data_offsets':[4,12]}}", 12, PARSE,
         "tensor 'b': data_offsets [4, 12] leave a hole of 4 bytes"},
        {"{" T1 "}", 4, PARSE, "tensor 'a': data_offsets [0, 8] run past the end of the data"},
        {"{" T1 ",'b':{'dtype':'F32','shape':[2],'data_offsets':[8,16]}}", 12, PARSE,
         "tensor 'b': data_offsets [8, 16] run past the end"},
        {"{" T1 "}", 9, PARSE, "the tensors cover 8 bytes of data but the file holds 9"},
        {"{}", 3, PARSE, "the tensors cover 0 bytes of data but the file holds 3"},
        {"{'__metadata__':[1]," T1 "}", 8, PARSE, "__metadata__ is not an object"},
        {"{'__metadata__':{'k':1}," T1 "}", 8, PARSE, "__metadata__: the value of 'k'"},
        {"{'a':{'dtype':'F32','shape':[2],'data_offsets':[0,99999999999999999999]}}", 8, PARSE,
         "not valid JSON"},
    };
    return cr_make_param_array(bad_hdr_t, cases, sizeof(cases) / sizeof(cases[0]));
}

ParameterizedTest(bad_hdr_t *c, safetensors, hostile)
{
    static unsigned char file[4096];
    size_t size = image(file, sizeof(file), c->hdr, (size_t)c->data);
    char err[512];
    memset(err, 'x', sizeof(err));
    err[sizeof(err) - 1] = '\0';
    mfsdp_st_header_t *h = POISON;
    mfsdp_status_t st = mfsdp_st_parse_buffer(file, size, "evil.safetensors", err, sizeof(err), &h);
    cr_assert_eq(st, c->status, "%s: got %s: %s", c->hdr, mfsdp_status_string(st), err);
    cr_assert_eq(h, POISON, "output written on failure");
    cr_assert(strncmp(err, "evil.safetensors: ", 18) == 0, "message must name the file: %s", err);
    cr_assert(strstr(err, c->expect) != NULL, "expected '%s' in: %s", c->expect, err);
    cr_assert_null(strchr(err, '\n'), "one line: %s", err);

    /* the same bytes through a file: the same refusal */
    char path[128];
    snprintf(path, sizeof(path), "%s/evil.safetensors", g_dir);
    FILE *fp = fopen(path, "wb");
    fwrite(file, 1, size, fp);
    fclose(fp);
    mfsdp_st_file_t *f = (mfsdp_st_file_t *)(uintptr_t)0x5a5a5a5a;
    cr_assert_eq(mfsdp_st_open(path, err, sizeof(err), &f), c->status, "%s", err);
    cr_assert(strstr(err, c->expect) != NULL, "expected '%s' in: %s", c->expect, err);
}

Test(safetensors, hostile_lengths)
{
    unsigned char file[64] = {0};
    char err[256];
    mfsdp_st_header_t *h = POISON;
    /* shorter than the length field */
    cr_assert_eq(mfsdp_st_parse_buffer(file, 5, "short", err, sizeof(err), &h), MFSDP_ERR_PARSE);
    cr_assert(strstr(err, "short: the file has 5 bytes, fewer than the 8-byte header") != NULL,
              "%s", err);
    /* a huge header length */
    memset(file, 0, sizeof(file));
    file[5] = 1; /* 2^40 */
    cr_assert_eq(mfsdp_st_parse_buffer(file, sizeof(file), "huge", err, sizeof(err), &h),
                 MFSDP_ERR_PARSE);
    cr_assert(strstr(err, "header length 1099511627776 exceeds the limit") != NULL, "%s", err);
    memset(file, 0xff, 8); /* 2^64 - 1: no overflow in 8 + N */
    cr_assert_eq(mfsdp_st_parse_buffer(file, sizeof(file), "huge", err, sizeof(err), &h),
                 MFSDP_ERR_PARSE);
    /* within the limit but past the end of the file */
    memset(file, 0, 8);
    file[0] = 100;
    cr_assert_eq(mfsdp_st_parse_buffer(file, sizeof(file), "past", err, sizeof(err), &h),
                 MFSDP_ERR_PARSE);
    cr_assert(strstr(err, "header length 100 runs past the end of the 64-byte file") != NULL, "%s",
              err);
    /* zero length: no JSON at all */
    memset(file, 0, 8);
    cr_assert_eq(mfsdp_st_parse_buffer(file, 8, "zero", err, sizeof(err), &h), MFSDP_ERR_PARSE);
    cr_assert(strstr(err, "does not start with '{'") != NULL, "%s", err);
    /* NUL and invalid UTF-8 inside the header */
    static const char nul[] = "{\"a\0\":1}";
    unsigned char f2[64];
    memset(f2, 0, sizeof(f2));
    f2[0] = sizeof(nul) - 1;
    memcpy(f2 + 8, nul, sizeof(nul) - 1);
    cr_assert_eq(mfsdp_st_parse_buffer(f2, 8 + sizeof(nul) - 1, "nul", err, sizeof(err), &h),
                 MFSDP_ERR_PARSE);
    static const char bad8[] = "{\"\xff\xfe\":{}}";
    f2[0] = sizeof(bad8) - 1;
    memcpy(f2 + 8, bad8, sizeof(bad8) - 1);
    cr_assert_eq(mfsdp_st_parse_buffer(f2, 8 + sizeof(bad8) - 1, "utf8", err, sizeof(err), &h),
                 MFSDP_ERR_PARSE);
    cr_assert_eq(h, POISON);
}

Test(safetensors, accepts_any_key_order_and_zero_size_tensors)
{
    static unsigned char file[512];
    size_t size = image(file, sizeof(file),
                        "{'z':{'dtype':'U8','shape':[3],'data_offsets':[8,11]},"
                        "'e1':{'dtype':'F32','shape':[0,4],'data_offsets':[8,8]},"
                        "'a':{'dtype':'F64','shape':[],'data_offsets':[0,8]},"
                        "'e0':{'dtype':'BF16','shape':[0],'data_offsets':[0,0]},"
                        "'__metadata__':{}}   ",
                        11);
    mfsdp_st_header_t *h = NULL;
    char err[256] = "";
    cr_assert_eq(mfsdp_st_parse_buffer(file, size, "order", err, sizeof(err), &h), MFSDP_OK, "%s",
                 err);
    cr_assert_eq(h->ntensors, 4);
    /* buffer order: by offset, then end (zero-size tensors before the data at their offset) */
    cr_assert_str_eq(h->tensors[0].name, "e0");
    cr_assert_str_eq(h->tensors[1].name, "a");
    cr_assert_str_eq(h->tensors[2].name, "e1");
    cr_assert_eq(h->tensors[3].begin, 8);
    cr_assert_str_eq(h->tensors[3].name, "z");
    cr_assert_eq(mfsdp_st_find(h, "e1")->numel, 0);
    cr_assert_eq(mfsdp_st_find(h, "a")->ndim, 0);
    cr_assert_eq(mfsdp_st_find(h, "a")->numel, 1);
    mfsdp_st_header_free(h);
}

/* ---- writer errors, truncation ----------------------------------------------------------- */

Test(safetensors, writer_refuses_bad_entries)
{
    float v[4] = {0};
    char path[128], hex[MFSDP_SHA256_HEX];
    snprintf(path, sizeof(path), "%s/bad.safetensors", g_dir);
    mfsdp_st_entry_t dup[2] = {
        {.name = "a", .dtype = MFSDP_ST_F32, .ndim = 1, .shape = {4}, .bytes = 16, .data = v},
        {.name = "a", .dtype = MFSDP_ST_F32, .ndim = 1, .shape = {4}, .bytes = 16, .data = v},
    };
    cr_assert_eq(mfsdp_st_write(path, dup, 2, NULL, NULL, 0, NULL, hex, NULL),
                 MFSDP_ERR_INVALID_ARG);
    mfsdp_st_entry_t size = {
        .name = "a", .dtype = MFSDP_ST_F32, .ndim = 1, .shape = {4}, .bytes = 12, .data = v};
    cr_assert_eq(mfsdp_st_write(path, &size, 1, NULL, NULL, 0, NULL, hex, NULL),
                 MFSDP_ERR_INVALID_ARG);
    mfsdp_st_entry_t meta = {.name = "__metadata__",
                             .dtype = MFSDP_ST_F32,
                             .ndim = 1,
                             .shape = {4},
                             .bytes = 16,
                             .data = v};
    cr_assert_eq(mfsdp_st_write(path, &meta, 1, NULL, NULL, 0, NULL, hex, NULL),
                 MFSDP_ERR_INVALID_ARG);
    mfsdp_st_entry_t nodata = {
        .name = "a", .dtype = MFSDP_ST_F32, .ndim = 1, .shape = {4}, .bytes = 16, .data = NULL};
    cr_assert_eq(mfsdp_st_write(path, &nodata, 1, NULL, NULL, 0, NULL, hex, NULL),
                 MFSDP_ERR_INVALID_ARG);
    struct stat sb;
    cr_assert_neq(stat(path, &sb), 0, "nothing written");
    /* a directory that does not exist: an i/o error, no file */
    cr_assert_eq(
        mfsdp_st_write("/nonexistent-dir/x.safetensors", &size, 0, NULL, NULL, 0, NULL, hex, NULL),
        MFSDP_ERR_IO);
}

static mfsdp_status_t fill_ramp(void *arg, size_t entry, uint64_t off, void *buf, size_t len)
{
    (void)arg;
    unsigned char *b = buf;
    for (size_t i = 0; i < len; i++) {
        b[i] = (unsigned char)((off + i) * 31 + entry);
    }
    return MFSDP_OK;
}

static int g_points;
static void count_point(void *arg, const char *what, const char *file, const char *key)
{
    (void)arg;
    (void)file;
    (void)key;
    (void)what;
    g_points++;
}

Test(safetensors, fill_callback_and_truncation)
{
    /* 20 MiB through the fill callback: several fill chunks */
    mfsdp_st_entry_t e[2] = {
        {.name = "big", .dtype = MFSDP_ST_U8, .ndim = 1, .shape = {20 << 20}, .bytes = 20 << 20},
        {.name = "small", .dtype = MFSDP_ST_I16, .ndim = 2, .shape = {3, 3}, .bytes = 18},
    };
    mfsdp_st_write_opts_t o = {.fill = fill_ramp, .point = count_point};
    char path[128], hex[MFSDP_SHA256_HEX];
    snprintf(path, sizeof(path), "%s/fill.safetensors", g_dir);
    g_points = 0;
    cr_assert_eq(mfsdp_st_write(path, e, 2, NULL, NULL, 0, &o, hex, NULL), MFSDP_OK);
    cr_assert_eq(g_points, 7, "open, header, 2 tensors, data, fsync, rename");
    mfsdp_st_file_t *f = NULL;
    char err[512] = "";
    cr_assert_eq(mfsdp_st_open(path, err, sizeof(err), &f), MFSDP_OK, "%s", err);
    const mfsdp_st_tensor_t *t = mfsdp_st_find(f->hdr, "big");
    unsigned char got[64], want[64];
    cr_assert_eq(mfsdp_st_read(f, t, (9 << 20) + 5, sizeof(got), got, NULL, 0), MFSDP_OK);
    fill_ramp(NULL, 0, (9 << 20) + 5, want, sizeof(want));
    cr_assert_eq(memcmp(got, want, sizeof(got)), 0);
    /* the file shrinks under an open reader: a read past the new end is an error */
    cr_assert_eq(truncate(path, (off_t)(f->hdr->data_start + (1 << 20))), 0);
    cr_assert_eq(mfsdp_st_read(f, t, 2 << 20, 16, got, err, sizeof(err)), MFSDP_ERR_IO);
    cr_assert(strstr(err, "tensor 'big': read failed: the file is shorter") != NULL, "%s", err);
    mfsdp_st_close(f);
    /* and reopening refuses it outright */
    cr_assert_eq(mfsdp_st_open(path, err, sizeof(err), &f), MFSDP_ERR_PARSE);
    cr_assert(strstr(err, "run past the end of the data") != NULL, "%s", err);
    cr_assert_eq(mfsdp_st_open("/nonexistent.safetensors", err, sizeof(err), &f),
                 MFSDP_ERR_NOT_FOUND);
}
