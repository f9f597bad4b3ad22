/*
 * The native floor of kvd's throughput case: batches of one-block READs,
 * each with its own notification, between two processes that drive NIXL
 * from C (NIXL's C API, libnixl_capi.so from the nixl wheel) with no Python
 * anywhere. What is left of a load's CPU here is NIXL's and UCX's own; what
 * kvd or plain-Python NIXL spends above it is theirs.
 *
 *   nixl_reads SECONDS BATCH BLOCK_LEN NUM_BLOCKS [PROGRESS_US [NUM_THREADS]]
 *
 * PROGRESS_US: the timeout of NIXL's progress thread's poll() (0, the
 * default: it spins, as NIXL's Python API and vLLM's NixlConnector leave
 * it; kvd's daemons set a few ms). NUM_THREADS: the UCX backend's
 * "num_threads" (0, the default: the backend's own; vLLM's connector: 4).
 *
 * The parent is the reader, a forked child the source: each registers a
 * buffer of NUM_BLOCKS x BLOCK_LEN bytes as DRAM with a UCX backend, and
 * they swap agent metadata and the source's buffer address over pipes. The
 * reader prepares both descriptor lists once (as vLLM's NixlConnector does
 * at handshake), then for SECONDS posts batches of BATCH READs of one block
 * each (make_xfer_req with one index on each side, post with a notification
 * naming the load), polls them to DONE and releases them. The source polls
 * get_notifs (sleeping 50 us when there are none) and counts them. Both
 * processes report their CPU (getrusage, every thread) over the timed
 * window; the reader prints one JSON object on stdout.
 *
 * The declarations below are the few C API calls this program uses, written
 * from NIXL's src/bindings/rust/wrapper.h (ai-dynamo/nixl): the wheel ships
 * the library, not the header.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <math.h>
#include <signal.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/select.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

typedef int status_t; /* 0 success, 1 in progress, < 0 an error */
typedef void *handle_t;
enum { MEM_DRAM = 0 };
enum { OP_READ = 0 };

/* nixl_capi_agent_config_t of wrapper.h (unchanged since NIXL's Rust agent configuration, PR 824). */
typedef struct {
    bool enable_prog_thread;
    bool enable_listen_thread;
    int listen_port;
    int thread_sync; /* 0: NIXL_CAPI_THREAD_SYNC_NONE, NIXL's Python default without a listener */
    unsigned int num_workers;
    uint64_t pthr_delay_us;
    uint64_t lthr_delay_us;
    bool capture_telemetry;
} agent_config_t;

status_t nixl_capi_create_configured_agent(const char *name, const agent_config_t *cfg, handle_t *agent);
status_t nixl_capi_destroy_agent(handle_t agent);
status_t nixl_capi_get_plugin_params(handle_t agent, const char *plugin, handle_t *mems, handle_t *params);
status_t nixl_capi_params_add(handle_t params, const char *key, const char *value);
status_t nixl_capi_destroy_params(handle_t params);
status_t nixl_capi_destroy_mem_list(handle_t mems);
status_t nixl_capi_create_backend(handle_t agent, const char *plugin, handle_t params, handle_t *backend);
status_t nixl_capi_create_opt_args(handle_t *args);
status_t nixl_capi_opt_args_add_backend(handle_t args, handle_t backend);
status_t nixl_capi_opt_args_set_notif_msg(handle_t args, const void *data, size_t len);
status_t nixl_capi_opt_args_set_has_notif(handle_t args, bool has_notif);
status_t nixl_capi_create_reg_dlist(int mem_type, handle_t *dlist);
status_t nixl_capi_reg_dlist_add_desc(handle_t dlist, uintptr_t addr, size_t len, uint64_t dev_id,
                                      const void *metadata, size_t metadata_len);
status_t nixl_capi_register_mem(handle_t agent, handle_t dlist, handle_t opt_args);
status_t nixl_capi_get_local_md(handle_t agent, void **data, size_t *len);
status_t nixl_capi_load_remote_md(handle_t agent, const void *data, size_t len, char **agent_name);
status_t nixl_capi_create_xfer_dlist(int mem_type, handle_t *dlist);
status_t nixl_capi_xfer_dlist_add_desc(handle_t dlist, uintptr_t addr, size_t len, uint64_t dev_id);
status_t nixl_capi_prep_xfer_dlist(handle_t agent, const char *agent_name, handle_t descs, handle_t *dlist_handle,
                                   handle_t opt_args);
status_t nixl_capi_make_xfer_req(handle_t agent, int op, handle_t local, const int *local_idx, size_t nlocal,
                                 handle_t remote, const int *remote_idx, size_t nremote, handle_t *req,
                                 handle_t opt_args);
status_t nixl_capi_post_xfer_req(handle_t agent, handle_t req, handle_t opt_args);
status_t nixl_capi_get_xfer_status(handle_t agent, handle_t req);
status_t nixl_capi_release_xfer_req(handle_t agent, handle_t req);
status_t nixl_capi_destroy_xfer_req(handle_t req);
status_t nixl_capi_create_notif_map(handle_t *map);
status_t nixl_capi_get_notifs(handle_t agent, handle_t map, handle_t opt_args);
status_t nixl_capi_notif_map_size(handle_t map, size_t *size);
status_t nixl_capi_notif_map_get_agent_at(handle_t map, size_t index, const char **agent_name);
status_t nixl_capi_notif_map_get_notifs_size(handle_t map, const char *agent_name, size_t *size);
status_t nixl_capi_notif_map_clear(handle_t map);

#define CHECK(call)                                                                        \
    do {                                                                                   \
        status_t rc_ = (call);                                                             \
        if (rc_ < 0) {                                                                     \
            fprintf(stderr, "nixl_reads: %s failed (%d) at line %d\n", #call, rc_, __LINE__); \
            exit(2);                                                                       \
        }                                                                                  \
    } while (0)

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static double cpu_s(void) { /* user + system seconds of every thread of this process */
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return ru.ru_utime.tv_sec + ru.ru_stime.tv_sec + (ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) * 1e-6;
}

static char *alloc_blocks(size_t bytes, int fill) { /* page-aligned, rounded up to whole pages */
    size_t rounded = (bytes + 4095) & ~(size_t)4095;
    char *buf = aligned_alloc(4096, rounded);
    if (!buf) {
        fprintf(stderr, "nixl_reads: cannot allocate %zu bytes\n", rounded);
        exit(2);
    }
    memset(buf, fill, rounded);
    return buf;
}

static void write_all(int fd, const void *buf, size_t len) {
    const char *p = buf;
    while (len) {
        ssize_t n = write(fd, p, len);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0) {
            perror("nixl_reads: write");
            exit(2);
        }
        p += n;
        len -= (size_t)n;
    }
}

static void read_all(int fd, void *buf, size_t len) {
    char *p = buf;
    while (len) {
        ssize_t n = read(fd, p, len);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0) {
            fprintf(stderr, "nixl_reads: the other process went away\n");
            exit(2);
        }
        p += n;
        len -= (size_t)n;
    }
}

static void send_blob(int fd, const void *data, uint64_t len) {
    write_all(fd, &len, sizeof len);
    write_all(fd, data, len);
}

static void *recv_blob(int fd, uint64_t *len) {
    read_all(fd, len, sizeof *len);
    if (*len > (1u << 26)) {
        fprintf(stderr, "nixl_reads: metadata of %llu bytes refused\n", (unsigned long long)*len);
        exit(2);
    }
    void *data = malloc(*len);
    read_all(fd, data, *len);
    return data;
}

static uint64_t progress_us; /* PROGRESS_US */
static int num_threads;       /* NUM_THREADS */

/* An agent with NIXL's progress thread, a UCX backend and a registered
 * buffer of `bytes`. */
static handle_t make_agent(const char *name, char *buf, size_t bytes, handle_t *backend) {
    handle_t agent, mems, params, opt, dl;
    agent_config_t cfg = {.enable_prog_thread = true, .pthr_delay_us = progress_us, .lthr_delay_us = 100000};
    CHECK(nixl_capi_create_configured_agent(name, &cfg, &agent));
    CHECK(nixl_capi_get_plugin_params(agent, "UCX", &mems, &params));
    if (num_threads > 0) {
        char n[16];
        snprintf(n, sizeof n, "%d", num_threads);
        CHECK(nixl_capi_params_add(params, "num_threads", n));
    }
    CHECK(nixl_capi_create_backend(agent, "UCX", params, backend));
    nixl_capi_destroy_params(params);
    nixl_capi_destroy_mem_list(mems);
    CHECK(nixl_capi_create_opt_args(&opt));
    CHECK(nixl_capi_opt_args_add_backend(opt, *backend));
    CHECK(nixl_capi_create_reg_dlist(MEM_DRAM, &dl));
    CHECK(nixl_capi_reg_dlist_add_desc(dl, (uintptr_t)buf, bytes, 0, NULL, 0));
    CHECK(nixl_capi_register_mem(agent, dl, opt));
    return agent;
}

static void exchange_md(handle_t agent, int out, int in, char **peer) {
    void *md;
    size_t len;
    uint64_t plen;
    CHECK(nixl_capi_get_local_md(agent, &md, &len));
    send_blob(out, md, len);
    free(md);
    void *pmd = recv_blob(in, &plen);
    CHECK(nixl_capi_load_remote_md(agent, pmd, plen, peer));
    free(pmd);
}

static int run_source(int out, int in, size_t block_len, int num_blocks) {
    size_t bytes = block_len * (size_t)num_blocks;
    char *buf = alloc_blocks(bytes, 7);
    handle_t backend, map;
    handle_t agent = make_agent("native-source", buf, bytes, &backend);
    char *peer;
    exchange_md(agent, out, in, &peer);
    uint64_t addr = (uintptr_t)buf;
    write_all(out, &addr, sizeof addr);
    CHECK(nixl_capi_create_notif_map(&map));
    char cmd;
    read_all(in, &cmd, 1); /* 's': the timed window starts */
    double c0 = cpu_s();
    uint64_t notifs = 0;
    struct timespec pause = {0, 50000};
    for (uint64_t i = 0;; i++) {
        CHECK(nixl_capi_get_notifs(agent, map, NULL));
        size_t agents = 0, n = 0, got = 0;
        nixl_capi_notif_map_size(map, &agents);
        for (size_t a = 0; a < agents; a++) {
            const char *name;
            nixl_capi_notif_map_get_agent_at(map, a, &name);
            nixl_capi_notif_map_get_notifs_size(map, name, &n);
            got += n;
        }
        nixl_capi_notif_map_clear(map);
        notifs += got;
        if (!got)
            nanosleep(&pause, NULL);
        if ((i & 255) == 0) { /* the reader's 'e' (end), without a syscall per poll */
            fd_set rd;
            FD_ZERO(&rd);
            FD_SET(in, &rd);
            struct timeval tv = {0, 0};
            if (select(in + 1, &rd, NULL, NULL, &tv) > 0)
                break;
        }
    }
    read_all(in, &cmd, 1);
    double used = cpu_s() - c0;
    write_all(out, &used, sizeof used);
    write_all(out, &notifs, sizeof notifs);
    return 0;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static int run_reader(int out, int in, double seconds, int batch, size_t block_len, int num_blocks) {
    size_t bytes = block_len * (size_t)num_blocks;
    char *buf = alloc_blocks(bytes, 0);
    char *target = calloc((size_t)num_blocks, 1); /* local blocks some READ filled */
    handle_t backend, ldl, rdl, lh, rh;
    handle_t agent = make_agent("native-reader", buf, bytes, &backend);
    char *peer;
    exchange_md(agent, out, in, &peer);
    uint64_t raddr;
    read_all(in, &raddr, sizeof raddr);
    CHECK(nixl_capi_create_xfer_dlist(MEM_DRAM, &ldl));
    CHECK(nixl_capi_create_xfer_dlist(MEM_DRAM, &rdl));
    for (int b = 0; b < num_blocks; b++) {
        CHECK(nixl_capi_xfer_dlist_add_desc(ldl, (uintptr_t)buf + b * block_len, block_len, 0));
        CHECK(nixl_capi_xfer_dlist_add_desc(rdl, raddr + b * block_len, block_len, 0));
    }
    CHECK(nixl_capi_prep_xfer_dlist(agent, "", ldl, &lh, NULL)); /* "": this agent (NIXL_INIT_AGENT) */
    CHECK(nixl_capi_prep_xfer_dlist(agent, peer, rdl, &rh, NULL));
    handle_t *reqs = calloc(batch, sizeof *reqs);
    handle_t *opts = calloc(batch, sizeof *opts);
    size_t max_batches = (size_t)(seconds * 1e6) + 16;
    double *walls = calloc(max_batches, sizeof *walls);
    if (!target || !reqs || !opts || !walls) {
        fprintf(stderr, "nixl_reads: out of memory\n");
        return 2;
    }
    char msg[64];
    for (int i = 0; i < batch; i++) {
        CHECK(nixl_capi_create_opt_args(&opts[i]));
        CHECK(nixl_capi_opt_args_set_has_notif(opts[i], true));
    }
    uint64_t loads = 0, serial = 0;
    size_t nb = 0;
    int warm = 3; /* untimed batches: connection setup, first use */
    double c0 = 0, t0 = 0;
    for (;;) {
        if (warm == 0) {
            write_all(out, "s", 1);
            c0 = cpu_s();
            t0 = now_s();
            warm = -1;
        }
        if (warm < 0 && now_s() - t0 >= seconds)
            break;
        double b0 = now_s();
        int left = 0;
        for (int i = 0; i < batch; i++) {
            int li = (int)((serial * 7) % (uint64_t)num_blocks), ri = (int)((serial * 13 + 5) % (uint64_t)num_blocks);
            int n = snprintf(msg, sizeof msg, "load-%llu", (unsigned long long)serial++);
            target[li] = 1;
            CHECK(nixl_capi_make_xfer_req(agent, OP_READ, lh, &li, 1, rh, &ri, 1, &reqs[i], NULL));
            CHECK(nixl_capi_opt_args_set_notif_msg(opts[i], msg, (size_t)n));
            status_t st = nixl_capi_post_xfer_req(agent, reqs[i], opts[i]);
            CHECK(st);
            if (st == 0) {
                nixl_capi_release_xfer_req(agent, reqs[i]);
                nixl_capi_destroy_xfer_req(reqs[i]);
                reqs[i] = NULL;
            } else {
                left++;
            }
        }
        while (left) {
            for (int i = 0; i < batch; i++) {
                if (!reqs[i])
                    continue;
                status_t st = nixl_capi_get_xfer_status(agent, reqs[i]);
                CHECK(st);
                if (st == 0) {
                    nixl_capi_release_xfer_req(agent, reqs[i]);
                    nixl_capi_destroy_xfer_req(reqs[i]);
                    reqs[i] = NULL;
                    left--;
                }
            }
        }
        if (warm > 0) {
            warm--;
            continue;
        }
        if (nb < max_batches)
            walls[nb++] = now_s() - b0;
        loads += (uint64_t)batch;
    }
    double elapsed = now_s() - t0, used = cpu_s() - c0;
    usleep(200000); /* the last notifications reach the source */
    write_all(out, "e", 1);
    double src_cpu;
    uint64_t notifs;
    read_all(in, &src_cpu, sizeof src_cpu);
    read_all(in, &notifs, sizeof notifs);
    if (!loads || !nb) {
        fprintf(stderr, "nixl_reads: no batch finished in %g s\n", seconds);
        return 3;
    }
    qsort(walls, nb, sizeof *walls, cmp_double);
    double med = walls[nb / 2];
    /* Every block some READ filled holds the source's bytes (7), every other one is untouched (0). */
    for (size_t b = 0; b < bytes; b++) {
        int want = target[b / block_len] ? 7 : 0;
        if (buf[b] != want) {
            fprintf(stderr, "nixl_reads: byte %zu is %d, not %d\n", b, buf[b], want);
            return 3;
        }
    }
    printf("{\"loads\": %llu, \"seconds\": %.3f, \"batch\": %d, \"block_len\": %zu, \"batches\": %zu, "
           "\"median_batch_loads_s\": %.1f, \"loads_s\": %.1f, \"reader_cpu_us_per_load\": %.2f, "
           "\"source_cpu_us_per_load\": %.2f, \"notifs_seen\": %llu, \"progress_us\": %llu, \"num_threads\": %d}\n",
           (unsigned long long)loads, elapsed, batch, block_len, nb, med > 0 ? batch / med : 0.0,
           loads / elapsed, used / loads * 1e6, src_cpu / loads * 1e6, (unsigned long long)notifs,
           (unsigned long long)progress_us, num_threads);
    return 0;
}

int main(int argc, char **argv) {
    if (argc < 5 || argc > 7) {
        fprintf(stderr, "usage: %s SECONDS BATCH BLOCK_LEN NUM_BLOCKS [PROGRESS_US [NUM_THREADS]]\n", argv[0]);
        return 64;
    }
    progress_us = argc > 5 ? strtoull(argv[5], NULL, 10) : 0;
    num_threads = argc > 6 ? atoi(argv[6]) : 0;
    double seconds = atof(argv[1]);
    int batch = atoi(argv[2]), num_blocks = atoi(argv[4]);
    long block_len = atol(argv[3]);
    if (!isfinite(seconds) || seconds < 0.01 || seconds > 3600 || batch <= 0 || batch > 4096 || block_len <= 0 ||
        block_len > (1L << 30) || num_blocks <= 0 || num_blocks > (1 << 20) ||
        (double)block_len * num_blocks > (double)(1ULL << 34)) {
        fprintf(stderr, "nixl_reads: 0.01 <= SECONDS <= 3600, 1 <= BATCH <= 4096, 1 <= BLOCK_LEN <= 2^30, "
                        "1 <= NUM_BLOCKS <= 2^20, BLOCK_LEN x NUM_BLOCKS <= 16 GiB\n");
        return 64;
    }
    int p2c[2], c2p[2];
    if (pipe(p2c) || pipe(c2p)) {
        perror("nixl_reads: pipe");
        return 2;
    }
    pid_t pid = fork();
    if (pid < 0) {
        perror("nixl_reads: fork");
        return 2;
    }
    if (pid == 0) {
        close(p2c[1]);
        close(c2p[0]);
        return run_source(c2p[1], p2c[0], (size_t)block_len, num_blocks);
    }
    close(p2c[0]);
    close(c2p[1]);
    int rc = run_reader(p2c[1], c2p[0], seconds, batch, (size_t)block_len, num_blocks);
    if (rc)
        kill(pid, SIGKILL);
    int status = 0;
    waitpid(pid, &status, 0);
    return rc ? rc : (WIFEXITED(status) ? WEXITSTATUS(status) : 2);
}
