// kernel_emu_fiber.h (included by kernel_emu.h): the CTA's threads as fibers on the launching OS thread.
//
// A fiber is a stack and a saved stack pointer; emu_switch saves the callee-saved registers (and the FP control
// words) on the current stack, stores its pointer and loads the other's: what a function call would keep, so
// nothing else needs saving. The scheduler resumes the CTA's fibers round robin; one runs until it waits at a
// barrier that has not opened or returns. Stacks are kept between launches (mmap'd, a guard page below each).
#pragma once
// (its standard headers are kernel_emu.h's: they must come before that file's macros)

#if !defined(__x86_64__)
#error "the kernel emulator's fibers switch stacks in x86-64 assembly"
#endif

extern "C" void emu_switch(void** save_sp, void* load_sp);
asm(R"(
    .text
    .p2align 4
    .hidden emu_switch
    .type emu_switch, @function
emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size emu_switch, .-emu_switch
)");

namespace emu {
constexpr size_t STACK = 512 * 1024;     // the kernels' locals are register arrays (a few KB at most)

struct Fiber {
    void* sp = nullptr;
    unsigned char* stack = nullptr;     // mmap'd STACK + a guard page
    dim3 tid;
    bool done = false;
    unsigned long seen = 0;             // sched.progress when it last yielded
    WgQueue wg;
    CpQueue cp;
};

// Not thread_local (a dlopen'd library's TLS costs a call a read): one launch at a time per library (Hold below).
struct Sched {
    std::vector<Fiber> fibers;
    int n = 0;                          // the CTA's threads
    void* main_sp = nullptr;
    int cur = -1;
    unsigned long progress = 0;         // arrivals and exits: a full round of the fibers without one is a deadlock
    std::function<void(int)> body;      // runs CUDA thread t of the current CTA
};
inline Sched sched;

inline WgQueue& wg() { return sched.fibers[sched.cur].wg; }
inline CpQueue& cpq() { return sched.fibers[sched.cur].cp; }

// Switch from the running fiber to the next live one after it (round robin), or back to the launch when none is
// left; the fiber's context is saved in `save`.
inline void next(void** save) {
    for (int i = 1; i <= sched.n; i++) {
        const int t = (sched.cur + i) % sched.n;
        Fiber& f = sched.fibers[t];
        if (f.done || (t == sched.cur && i < sched.n)) continue;
        if (t == sched.cur) return;     // the only one left
        sched.cur = t;
        tid = f.tid;
        emu_switch(save, f.sp);
        return;
    }
    emu_switch(save, sched.main_sp);
}

inline void yield() {
    const int me = sched.cur;
    Fiber& f = sched.fibers[me];
    if (f.seen == sched.progress) {     // back here after a whole round in which nobody arrived anywhere
        std::fprintf(stderr, "kernel emulator: thread %d of CTA (%u, %u, %u) waits at a barrier that cannot open "
                     "(one not every thread of its CTA or warp reaches)\n", me, bid.x, bid.y, bid.z);
        std::abort();
    }
    f.seen = sched.progress;
    next(&f.sp);
    sched.cur = me;
    tid = f.tid;
}

inline void arrive_and_wait(Bar& b) {
    const unsigned ph = b.phase;
    sched.progress++;
    if (++b.count >= b.expected) {
        b.count = 0;
        b.phase++;
        return;
    }
    sched.fibers[sched.cur].seen = sched.progress - 1;     // its own arrival counts as progress for the round
    while (b.phase == ph) yield();
}

inline void arrive_and_drop(Bar& b) {
    sched.progress++;
    b.expected--;
    if (b.count > 0 && b.count >= b.expected) {
        b.count = 0;
        b.phase++;
    }
}

[[noreturn]] inline void fiber_entry() {
    const int me = sched.cur;
    sched.body(me);
    sched.fibers[me].done = true;
    void* dead;
    next(&dead);     // never switched back to
    __builtin_unreachable();
}

// a fresh context on f's stack whose first switch-in enters fiber_entry (as if called: rsp = 8 mod 16)
inline void prime(Fiber& f) {
    if (!f.stack) {
        void* m = mmap(nullptr, STACK + 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                       -1, 0);
        if (m == MAP_FAILED) std::abort();
        mprotect(m, 4096, PROT_NONE);
        f.stack = (unsigned char*)m;
    }
    std::uint64_t* top = (std::uint64_t*)(f.stack + 4096 + STACK);     // 16-aligned
    std::uint64_t* sp = top - 2;
    sp[0] = (std::uint64_t)(void*)&fiber_entry;                         // the switch's ret
    sp -= 6;                                                            // rbp rbx r12 r13 r14 r15
    for (int i = 0; i < 6; i++) sp[i] = 0;
    sp -= 1;
    unsigned csr;
    unsigned short cw;
    asm volatile("stmxcsr %0" : "=m"(csr));
    asm volatile("fnstcw %0" : "=m"(cw));
    std::memcpy(sp, &csr, 4);
    std::memcpy((unsigned char*)sp + 4, &cw, 2);
    f.sp = sp;
    f.done = false;
    f.seen = ~0ul;
    f.wg = WgQueue{};
    f.cp = CpQueue{};
}

// a module's __shared__ arrays are static: one launch at a time (C++20 atomic wait, not <mutex>, whose extern "C"
// functions kernel_emu.py would take for kernels)
inline std::atomic<bool> launching{false};
struct Hold {
    Hold() {
        while (launching.exchange(true, std::memory_order_acquire)) launching.wait(true);
    }
    ~Hold() {
        launching.store(false, std::memory_order_release);
        launching.notify_one();
    }
};

// Run `kernel(args...)` over grid x block with `smem` bytes of dynamic shared memory: the CTAs in order, each as
// block.x * block.y * block.z fibers. A CTA that writes past its shared memory (a launch sized too small on the
// host) leaves where it wrote in `error`, which the launch's entry reports (EMU_ENTRY, tests/kernel_emu.py).
constexpr size_t GUARD = 4096;
inline std::string error;
template <class... A>
void launch(void (*kernel)(A...), dim3 grid, dim3 block, size_t smem, A... args) {
    Hold hold;
    const int nt = (int)(block.x * block.y * block.z);
    const int nw = (nt + 31) / 32;
    cur_grid = grid;
    if ((int)sched.fibers.size() < nt) sched.fibers.resize(nt);
    for (unsigned bz = 0; bz < grid.z; bz++)
        for (unsigned by = 0; by < grid.y; by++)
            for (unsigned bx = 0; bx < grid.x; bx++) {
                Cta c;
                c.block = block;
                c.bar.expected = nt;
                c.warp_bar.resize(nw);
                for (int w = 0; w < nw; w++) c.warp_bar[w].expected = std::min(32, nt - 32 * w);
                c.slots.assign((size_t)nw * 64, 0);
                c.frag.assign((size_t)nw * 32 * 6, 0);
                // poison (NaN floats): a read of unstaged shared memory shows in the result, even times 0; the
                // GUARD bytes past the launch's allocation (and its 16 spare bytes) must come back untouched
                c.smem.assign(smem + 16 + GUARD, 0xFF);
                cta = &c;
                bid = dim3{bx, by, bz};
                sched.body = [&](int t) {
                    kernel(args...);
                    arrive_and_drop(c.warp_bar[t >> 5]);
                    arrive_and_drop(c.bar);
                };
                sched.n = nt;
                for (int t = 0; t < nt; t++) {
                    Fiber& f = sched.fibers[t];
                    prime(f);
                    f.tid = dim3{t % block.x, (t / block.x) % block.y, t / (block.x * block.y)};
                }
                // fiber 0 first; each switches to the next live one at a barrier, the last one out comes back here
                sched.cur = 0;
                tid = sched.fibers[0].tid;
                emu_switch(&sched.main_sp, sched.fibers[0].sp);
                sched.cur = -1;
                cta = nullptr;
                for (size_t i = smem + 16; i < c.smem.size() && error.empty(); i++)
                    if (c.smem[i] != 0xFF)
                        error = "CTA (" + std::to_string(bx) + ", " + std::to_string(by) + ", " + std::to_string(bz) +
                                ") wrote byte " + std::to_string(i) + " of shared memory, past the launch's " +
                                std::to_string(smem);
            }
}
}  // namespace emu
