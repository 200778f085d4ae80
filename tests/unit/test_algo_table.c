/* SPDX-License-Identifier: Apache-2.0 */
/* The measured algorithm table (MFSDP_ALGO_TABLE): parsing, every rejected line named by
 * its number, the first-match pick, and the row format read back. */
#include <criterion/criterion.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "core/algo_table.h"

static const char *good = "# written by hand\n"
                          "coll,nranks,min_bytes,max_bytes,algo\n"
                          "\n"
                          "allgather,2,0,1048575,chain\r\n"
                          "  allgather , 2 , 1048576 , -1 , direct \n"
                          "reducescatter,-1,0,-1,native\n"
                          "allgather,4,0,-1,native";

Test(algo_table, parse_and_pick)
{
    mfsdp_algo_table_t t;
    char err[256] = "";
    cr_assert_eq(mfsdp_algo_table_parse(good, "t.csv", &t, err, sizeof(err)), MFSDP_OK, "%s", err);
    cr_assert_eq(t.nrows, 4);
    cr_expect_eq(t.rows[1].max_bytes, SIZE_MAX);
    mfsdp_algo_t a = MFSDP_ALGO_AUTO;
    cr_expect_eq(mfsdp_algo_table_pick(&t, 0, 2, 0, &a), 1);
    cr_expect_eq(a, MFSDP_ALGO_CHAIN);
    cr_expect_eq(mfsdp_algo_table_pick(&t, 0, 2, 1048575, &a), 1);
    cr_expect_eq(a, MFSDP_ALGO_CHAIN);
    cr_expect_eq(mfsdp_algo_table_pick(&t, 0, 2, 1048576, &a), 1);
    cr_expect_eq(a, MFSDP_ALGO_DIRECT);
    cr_expect_eq(mfsdp_algo_table_pick(&t, 0, 2, SIZE_MAX, &a), 1);
    cr_expect_eq(a, MFSDP_ALGO_DIRECT);
    cr_expect_eq(mfsdp_algo_table_pick(&t, 0, 4, 7, &a), 1);
    cr_expect_eq(a, MFSDP_ALGO_NATIVE);
    /* -1 ranks: any world; the reduce rows do not answer for the all-gather */
    cr_expect_eq(mfsdp_algo_table_pick(&t, 1, 3, 12345, &a), 1);
    cr_expect_eq(a, MFSDP_ALGO_NATIVE);
    a = MFSDP_ALGO_AUTO;
    cr_expect_eq(mfsdp_algo_table_pick(&t, 0, 3, 12345, &a), 0, "no all-gather row for 3 ranks");
    cr_expect_eq(a, MFSDP_ALGO_AUTO, "no match leaves the output alone");
    cr_expect_eq(mfsdp_algo_table_pick(NULL, 0, 2, 1, &a), 0);
    mfsdp_algo_table_free(&t);
    cr_expect_eq(t.nrows, 0);
}

Test(algo_table, first_match_wins)
{
    mfsdp_algo_table_t t;
    cr_assert_eq(mfsdp_algo_table_parse("allgather,2,0,100,native\nallgather,2,0,-1,chain\n", NULL,
                                        &t, NULL, 0),
                 MFSDP_OK);
    mfsdp_algo_t a;
    cr_expect_eq(mfsdp_algo_table_pick(&t, 0, 2, 50, &a), 1);
    cr_expect_eq(a, MFSDP_ALGO_NATIVE);
    cr_expect_eq(mfsdp_algo_table_pick(&t, 0, 2, 101, &a), 1);
    cr_expect_eq(a, MFSDP_ALGO_CHAIN);
    mfsdp_algo_table_free(&t);
}

Test(algo_table, empty_table_has_no_rows)
{
    mfsdp_algo_table_t t;
    cr_assert_eq(mfsdp_algo_table_parse("# nothing\n\ncoll,nranks,min_bytes,max_bytes,algo\n", NULL,
                                        &t, NULL, 0),
                 MFSDP_OK);
    cr_expect_eq(t.nrows, 0);
    mfsdp_algo_t a;
    cr_expect_eq(mfsdp_algo_table_pick(&t, 0, 2, 1, &a), 0);
    mfsdp_algo_table_free(&t);
}

typedef struct bad_case {
    const char *text;
    const char *want; /* substring of the message */
} bad_case_t;

Test(algo_table, bad_lines_are_named)
{
    static const bad_case_t cases[] = {
        {"allgather,2,0,-1\n", "line 1: expected 5 comma-separated fields"},
        {"# ok\nallgather,2,0,-1,direct,x\n", "line 2: expected 5"},
        {"\n\nbroadcast,2,0,-1,direct\n", "line 3: collective 'broadcast'"},
        {"allgather,0,0,-1,direct\n", "line 1: nranks '0'"},
        {"allgather,-2,0,-1,direct\n", "line 1: nranks '-2'"},
        {"allgather,two,0,-1,direct\n", "line 1: nranks 'two'"},
        {"allgather,2,-1,-1,direct\n", "line 1: min_bytes '-1'"},
        {"allgather,2,1M,-1,direct\n", "line 1: min_bytes '1M'"},
        {"allgather,2,100,99,direct\n", "line 1: max_bytes '99'"},
        {"allgather,2,0,,direct\n", "line 1: max_bytes ''"},
        {"allgather,2,0,-1,ring\n", "line 1: algorithm 'ring'"},
        {"allgather,2,0,-1,auto\n", "line 1: algorithm 'auto'"},
        {"allgather,2,0,99999999999999999999999,direct\n", "line 1: max_bytes"},
        /* rows an earlier one covers never apply (the first match wins) */
        {"allgather,2,0,-1,direct\nallgather,2,0,-1,chain\n",
         "line 2: never used: the table's row 1"},
        {"allgather,-1,0,-1,direct\nreducescatter,2,0,-1,chain\nallgather,2,0,4096,native\n",
         "line 3: never used: the table's row 1"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        mfsdp_algo_table_t t = {.nrows = 7};
        char err[256] = "";
        cr_expect_eq(mfsdp_algo_table_parse(cases[i].text, "tab.csv", &t, err, sizeof(err)),
                     MFSDP_ERR_CONFIG, "case %zu accepted", i);
        cr_expect(strstr(err, cases[i].want) != NULL && strncmp(err, "tab.csv line", 12) == 0,
                  "case %zu: message '%s' lacks '%s'", i, err, cases[i].want);
        cr_expect_eq(t.nrows, 0);
        cr_expect_null(t.rows);
    }
    char longline[700];
    memset(longline, 'a', sizeof(longline) - 1);
    longline[sizeof(longline) - 1] = '\0';
    mfsdp_algo_table_t t;
    char err[256] = "";
    cr_expect_eq(mfsdp_algo_table_parse(longline, "x", &t, err, sizeof(err)), MFSDP_ERR_CONFIG);
    cr_expect(strstr(err, "x line 1: longer than") != NULL, "%s", err);
}

Test(algo_table, format_reads_back)
{
    mfsdp_algo_table_t t;
    cr_assert_eq(mfsdp_algo_table_parse(good, NULL, &t, NULL, 0), MFSDP_OK);
    char text[1024] = "";
    for (size_t i = 0; i < t.nrows; i++) {
        char line[160];
        mfsdp_algo_row_format(&t.rows[i], line, sizeof(line));
        strcat(text, line);
        strcat(text, "\n");
    }
    cr_expect_str_eq(text, "allgather,2,0,1048575,chain\n"
                           "allgather,2,1048576,-1,direct\n"
                           "reducescatter,-1,0,-1,native\n"
                           "allgather,4,0,-1,native\n");
    mfsdp_algo_table_t u;
    cr_assert_eq(mfsdp_algo_table_parse(text, NULL, &u, NULL, 0), MFSDP_OK);
    cr_assert_eq(u.nrows, t.nrows);
    cr_expect_eq(memcmp(u.rows, t.rows, t.nrows * sizeof(*t.rows)), 0);
    mfsdp_algo_table_free(&t);
    mfsdp_algo_table_free(&u);
}

Test(algo_table, load_file)
{
    char path[] = "/tmp/mfsdp-algo-table-XXXXXX";
    int fd = mkstemp(path);
    cr_assert(fd >= 0);
    cr_assert_eq(write(fd, good, strlen(good)), (ssize_t)strlen(good));
    close(fd);
    mfsdp_algo_table_t t;
    char err[256] = "";
    cr_expect_eq(mfsdp_algo_table_load(path, &t, err, sizeof(err)), MFSDP_OK, "%s", err);
    cr_expect_eq(t.nrows, 4);
    mfsdp_algo_table_free(&t);
    unlink(path);
    cr_expect_eq(mfsdp_algo_table_load(path, &t, err, sizeof(err)), MFSDP_ERR_IO);
    cr_expect(strstr(err, "cannot open") != NULL, "%s", err);
}
