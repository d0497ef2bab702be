/* memcount: count the bytes malloc has handed out and not had back, with a resettable peak.

   Loaded with LD_PRELOAD, it wraps glibc's malloc family for the whole process, every thread
   (Python, c10's CPU allocator, gloo's worker threads, ...), and forwards to glibc's own
   __libc_* entry points. Sizes are malloc_usable_size of each block, counted when it is handed
   out and when it comes back. No allocator caching sits between this count and the program:
   a block counts from malloc to free. Read from Python with ctypes (benchmarks/memory_meter.py):

       memcount_current()      bytes in use now
       memcount_peak()         the most in use since the last reset
       memcount_reset_peak()   peak := current

   Build: cc -O2 -shared -fPIC -o memcount.so memcount.c   (glibc, Linux)
   Not counted: memory mapped directly with mmap (Python's small-object arenas, file mappings). */

#define _GNU_SOURCE
#include <errno.h>
#include <malloc.h>
#include <stddef.h>
#include <stdint.h>
#include <unistd.h>

extern void *__libc_malloc(size_t);
extern void __libc_free(void *);
extern void *__libc_calloc(size_t, size_t);
extern void *__libc_realloc(void *, size_t);
extern void *__libc_memalign(size_t, size_t);

static int64_t current_bytes = 0;
static int64_t peak_bytes = 0;

static void add(void *p) {
    if (!p) return;
    int64_t now = __atomic_add_fetch(&current_bytes, (int64_t)malloc_usable_size(p), __ATOMIC_RELAXED);
    int64_t peak = __atomic_load_n(&peak_bytes, __ATOMIC_RELAXED);
    while (now > peak && !__atomic_compare_exchange_n(&peak_bytes, &peak, now, 1, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
    }
}

static void sub(void *p) {
    if (p) __atomic_sub_fetch(&current_bytes, (int64_t)malloc_usable_size(p), __ATOMIC_RELAXED);
}

void *malloc(size_t n) { void *p = __libc_malloc(n); add(p); return p; }
void *calloc(size_t k, size_t n) { void *p = __libc_calloc(k, n); add(p); return p; }
void free(void *p) { sub(p); __libc_free(p); }
void cfree(void *p) { free(p); }

void *realloc(void *old, size_t n) {
    size_t before = old ? malloc_usable_size(old) : 0;
    void *p = __libc_realloc(old, n);
    if (p) {
        __atomic_sub_fetch(&current_bytes, (int64_t)before, __ATOMIC_RELAXED);
        add(p);
    } else if (old && n == 0) {  /* realloc(p, 0) freed p */
        __atomic_sub_fetch(&current_bytes, (int64_t)before, __ATOMIC_RELAXED);
    }
    return p;
}

void *memalign(size_t a, size_t n) { void *p = __libc_memalign(a, n); add(p); return p; }
void *aligned_alloc(size_t a, size_t n) { return memalign(a, n); }
void *valloc(size_t n) { return memalign((size_t)sysconf(_SC_PAGESIZE), n); }

void *pvalloc(size_t n) {
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    return memalign(page, (n + page - 1) / page * page);
}

int posix_memalign(void **out, size_t a, size_t n) {
    if (a % sizeof(void *) || (a & (a - 1))) return EINVAL;
    void *p = memalign(a, n);
    if (!p && n) return ENOMEM;
    *out = p;
    return 0;
}

int64_t memcount_current(void) { return __atomic_load_n(&current_bytes, __ATOMIC_RELAXED); }
int64_t memcount_peak(void) { return __atomic_load_n(&peak_bytes, __ATOMIC_RELAXED); }
void memcount_reset_peak(void) { __atomic_store_n(&peak_bytes, memcount_current(), __ATOMIC_RELAXED); }
