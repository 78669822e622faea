/* An LD_PRELOAD allocator that makes a write past the end of a tensor's buffer fault.
 *
 * torch's CPU allocator and oneDNN take their buffers from posix_memalign; each such
 * block here gets pages of its own that end at a page nobody may touch, the block's end
 * (rounded up to its alignment) at that page. A freed block's pages are unmapped, so a
 * use after free faults until the addresses are mapped again. Other allocations (Python
 * objects, glibc's own) go to glibc, whose checks notice a stray write only when the
 * damaged chunk is next touched, often much later or never; here the faulting
 * instruction is the write itself.
 *
 * Environment: GUARD_READ=1 leaves the page after a block readable, so that only a
 * write faults; GUARD_MAX (bytes, 256 MiB by default) bounds the blocks guarded.
 *
 *   cc -O2 -shared -fPIC -o guard_allocator.so guard_allocator.c -lpthread
 *   LD_PRELOAD=./guard_allocator.so python3 ...
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

extern void *__libc_memalign(size_t, size_t);
extern void *__libc_malloc(size_t);
extern void *__libc_realloc(void *, size_t);
extern void __libc_free(void *);

#define PAGE 4096u
#define SLOTS (1u << 22) /* live guarded blocks, open addressing */
#define EMPTY 0u
#define FREED 1u

static uintptr_t slot_block[SLOTS];
static void *slot_base[SLOTS];
static size_t slot_length[SLOTS];
static size_t slot_size[SLOTS];
static pthread_mutex_t slots_lock = PTHREAD_MUTEX_INITIALIZER;

static size_t slot_of(uintptr_t block) {
    return (size_t)((block >> 4) * 11400714819323198485ull >> 42) & (SLOTS - 1);
}

static size_t largest_guarded(void) {
    static size_t largest;
    if (!largest) {
        const char *given = getenv("GUARD_MAX");
        largest = given ? strtoull(given, NULL, 10) : (256u << 20);
    }
    return largest;
}

static void *guarded_block(size_t alignment, size_t size) {
    if (alignment < 16) alignment = 16;
    size_t rounded = (size + alignment - 1) / alignment * alignment;
    size_t data = (rounded + PAGE - 1) / PAGE * PAGE;
    char *base = mmap(NULL, data + PAGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                      -1, 0);
    if (base == MAP_FAILED) return NULL;
    mprotect(base + data, PAGE, getenv("GUARD_READ") ? PROT_READ : PROT_NONE);
    char *block = base + data - rounded;
    memset(block, 0xA5, rounded); /* not zeros: an unwritten result shows */
    pthread_mutex_lock(&slots_lock);
    size_t i = slot_of((uintptr_t)block);
    while (slot_block[i] > FREED) i = (i + 1) & (SLOTS - 1);
    slot_block[i] = (uintptr_t)block;
    slot_base[i] = base;
    slot_length[i] = data + PAGE;
    slot_size[i] = size;
    pthread_mutex_unlock(&slots_lock);
    return block;
}

/* The slot of a guarded block, or SLOTS; called with slots_lock held. */
static size_t find_slot(uintptr_t block) {
    for (size_t i = slot_of(block); slot_block[i] != EMPTY; i = (i + 1) & (SLOTS - 1))
        if (slot_block[i] == block) return i;
    return SLOTS;
}

int posix_memalign(void **out, size_t alignment, size_t size) {
    void *block;
    if (size && size <= largest_guarded() && alignment <= PAGE)
        block = guarded_block(alignment, size);
    else
        block = __libc_memalign(alignment, size);
    if (!block) return ENOMEM;
    *out = block;
    return 0;
}

void *aligned_alloc(size_t alignment, size_t size) {
    void *block;
    return posix_memalign(&block, alignment, size) ? NULL : block;
}

void *memalign(size_t alignment, size_t size) {
    void *block;
    return posix_memalign(&block, alignment, size) ? NULL : block;
}

void free(void *block) {
    if (!block) return;
    pthread_mutex_lock(&slots_lock);
    size_t i = find_slot((uintptr_t)block);
    if (i == SLOTS) {
        pthread_mutex_unlock(&slots_lock);
        __libc_free(block);
        return;
    }
    void *base = slot_base[i];
    size_t length = slot_length[i];
    slot_block[i] = FREED;
    pthread_mutex_unlock(&slots_lock);
    munmap(base, length);
}

void *realloc(void *block, size_t size) {
    if (block) {
        pthread_mutex_lock(&slots_lock);
        size_t i = find_slot((uintptr_t)block);
        size_t old = i == SLOTS ? 0 : slot_size[i];
        pthread_mutex_unlock(&slots_lock);
        if (i != SLOTS) {
            void *moved = __libc_malloc(size);
            if (moved) {
                memcpy(moved, block, old < size ? old : size);
                free(block);
            }
            return moved;
        }
    }
    return __libc_realloc(block, size);
}
