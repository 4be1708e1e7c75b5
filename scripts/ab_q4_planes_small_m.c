/* Prototype (not part of the package, twentieth session): the 4-bit g32 Gemma-shaped head at
   small M over exact int16 activation planes per row and group (eq_q4planes.h's planes, one set
   per activation row), codes widened to int16 dwords once per group and block, vpdpwssd for four
   (row, plane) pairs at a time; against the package's own native_bf16 (vdpbf16ps) and
   native_avx512f (FMA) builds, dlopen'ed from the kernel cache, same table, same M, 2 threads.
   Why: on an Emerald Rapids a zmm vpdpwssd (32 multiply-adds) costs ~0.24 ns, vfmadd231ps (16)
   ~0.19, vdpbf16ps (32) ~0.75 (scripts/vec_rates.c). Measured there in a noisy hour (medians of
   15, ms): M = 4 17.8 / 31.4 / 22.0, M = 8 18.8 / 19.8 / 16.3 and 30.6 / 32.6 / 28.5, M = 16
   42.7 / 32.0 / 30.5 and 44.6 / 29.2 / 30.3 (bf16 / avx512f / this) - not yet a clear win; its
   bound at M = 8 is ~5.6 ms of vpdpwssd. Outputs checked against native_avx512f's.

     PYTHONPATH=. python -c "from embedq.kernels import native_head, native_f32; \
       print(native_head.LIB.get()._name, native_f32.VARIANTS['avx512f'].get()._name)"
     gcc -O3 -march=native scripts/ab_q4_planes_small_m.c -o ab_q4m -ldl -lpthread -lm
     ./ab_q4m HEAD_BF16_SO HEAD_AVX512F_SO 8
*/
#include <immintrin.h>
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <time.h>
static double now(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+1e-9*t.tv_nsec;}
#define V 262144
#define K 640
#define G 20
#define NB (V/16)
#define KP (K/2)
#define MMAX 16
static uint8_t* W; static uint16_t* S; static float XF[MMAX*K]; static uint16_t XB[MMAX*K];
static int M;
/* planes: per (m, gi) a list; combos flattened per gi */
typedef struct { int m; float mul; int32_t corr; int32_t x[16]; } combo_t;
static combo_t* CB[G]; static int NCB[G];
static uint16_t OB[MMAX*V], OF[MMAX*V];
static uint16_t f2b(float f){uint32_t u;memcpy(&u,&f,4);return (u+0x7fff+((u>>16)&1))>>16;}
static float b2f(uint16_t h){uint32_t u=(uint32_t)h<<16;float f;memcpy(&f,&u,4);return f;}
static void build_planes(void){
  for(int gi=0;gi<G;gi++){ NCB[gi]=0; CB[gi]=malloc(sizeof(combo_t)*MMAX*32);
    for(int m=0;m<M;m++){ int32_t mk[32],fk[32],top[32]; int left[32];
      for(int k=0;k<32;k++){ float v=XF[m*K+gi*32+k]; uint32_t u; memcpy(&u,&v,4); uint32_t e=(u>>23)&255, fr=u&0x7fffff; left[k]=0;
        if(e==0&&fr==0) continue; uint32_t mm=e?fr|0x800000u:fr; int tz=__builtin_ctz(mm); mm>>=tz; int bl=32-__builtin_clz(mm);
        mk[k]=(u>>31)?-(int32_t)mm:(int32_t)mm; fk[k]=(int)(e?e:1)-150+tz; top[k]=fk[k]+bl; left[k]=1; }
      for(;;){ int T=-1000000; for(int k=0;k<32;k++) if(left[k]&&top[k]>T) T=top[k]; if(T==-1000000) break;
        int B=T-15<-149?-149:T-15; combo_t* c=&CB[gi][NCB[gi]++]; c->m=m; int32_t sum=0; int16_t v16[32];
        for(int k=0;k<32;k++){ int32_t v=0; if(left[k]&&fk[k]>=B){ v=mk[k]*(1<<(fk[k]-B)); left[k]=0; } v16[k]=(int16_t)v; sum+=v; }
        for(int p=0;p<16;p++){ uint32_t d=(uint16_t)v16[2*p]|((uint32_t)(uint16_t)v16[2*p+1]<<16); c->x[p]=(int32_t)d; }
        c->corr=8*sum; c->mul=ldexpf(1.0f,B); } } } }
typedef struct { int b0,b1; } job;
static void* proto(void* a){ job* j=a; __m512i wd[16];
  const __m512i m4=_mm512_set1_epi32(0xF), m4h=_mm512_set1_epi32(0xF0000);
  for(int nb=j->b0;nb<j->b1;nb++){ __m512 o[MMAX]; for(int m=0;m<M;m++) o[m]=_mm512_setzero_ps();
    for(int gi=0;gi<G;gi++){ const uint8_t* b=W+((size_t)nb*KP+gi*16)*16;
      _mm_prefetch((const char*)b+4096,_MM_HINT_T0); _mm_prefetch((const char*)b+4096+64,_MM_HINT_T0);
      _mm_prefetch((const char*)b+4096+128,_MM_HINT_T0); _mm_prefetch((const char*)b+4096+192,_MM_HINT_T0);
      for(int p=0;p<16;p++){ __m512i d=_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(b+p*16)));
        wd[p]=_mm512_or_si512(_mm512_and_si512(d,m4),_mm512_and_si512(_mm512_slli_epi32(d,12),m4h)); }
      __m512 t[MMAX]; for(int m=0;m<M;m++) t[m]=_mm512_setzero_ps();
      const combo_t* c=CB[gi]; int n=NCB[gi], i=0;
      for(;i+3<n;i+=4){ __m512i a0=_mm512_setzero_si512(),a1=a0,a2=a0,a3=a0;
        for(int p=0;p<16;p++){ __m512i w=wd[p];
          a0=_mm512_dpwssd_epi32(a0,w,_mm512_set1_epi32(c[i].x[p])); a1=_mm512_dpwssd_epi32(a1,w,_mm512_set1_epi32(c[i+1].x[p]));
          a2=_mm512_dpwssd_epi32(a2,w,_mm512_set1_epi32(c[i+2].x[p])); a3=_mm512_dpwssd_epi32(a3,w,_mm512_set1_epi32(c[i+3].x[p])); }
#define OUTC(A,I) t[c[I].m]=_mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(A,_mm512_set1_epi32(c[I].corr))),_mm512_set1_ps(c[I].mul),t[c[I].m]);
        OUTC(a0,i) OUTC(a1,i+1) OUTC(a2,i+2) OUTC(a3,i+3) }
      for(;i<n;i++){ __m512i a0=_mm512_setzero_si512(); for(int p=0;p<16;p++) a0=_mm512_dpwssd_epi32(a0,wd[p],_mm512_set1_epi32(c[i].x[p])); OUTC(a0,i) }
      __m512 s=_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(S+((size_t)nb*G+gi)*16))),16));
      for(int m=0;m<M;m++) o[m]=_mm512_fmadd_ps(t[m],s,o[m]); }
    for(int m=0;m<M;m++) _mm256_storeu_si256((__m256i*)(OB+(size_t)m*V+nb*16),(__m256i)_mm512_cvtneps_pbh(o[m])); }
  return 0; }
static double run_proto(void){ pthread_t t[2]; job js[2]; double t0=now();
  for(int i=0;i<2;i++){ js[i]=(job){NB*i/2,NB*(i+1)/2}; pthread_create(&t[i],0,proto,&js[i]); }
  for(int i=0;i<2;i++) pthread_join(t[i],0); return now()-t0; }
typedef int (*hb_t)(const uint8_t*,const void*,int,const int8_t*,int,int64_t,int64_t,int64_t,const uint16_t*,int64_t,uint16_t*,int64_t,int);
typedef int (*hf_t)(const uint8_t*,const void*,int,const int8_t*,int,int64_t,int64_t,int64_t,const float*,int64_t,void*,int,int64_t,int);
static int cmp(const void*a,const void*b){double x=*(double*)a,y=*(double*)b;return x<y?-1:x>y;}
int main(int argc,char** argv){ M=atoi(argv[3]);
  hb_t hb=(hb_t)dlsym(dlopen(argv[1],RTLD_NOW),"head_bf16"); hf_t hf=(hf_t)dlsym(dlopen(argv[2],RTLD_NOW),"head_f32");
  W=aligned_alloc(64,(size_t)NB*KP*16); for(size_t i=0;i<(size_t)NB*KP*16;i++) W[i]=rand();
  S=malloc(sizeof(uint16_t)*NB*G*16); for(int i=0;i<NB*G*16;i++) S[i]=f2b(0.01f*(1+rand()%100)/100);
  for(int i=0;i<M*K;i++){ float v=((rand()%20001)-10000)/5000.0f; XB[i]=f2b(v); XF[i]=b2f(XB[i]); }
  build_planes(); int np=0; for(int gi=0;gi<G;gi++) np+=NCB[gi]; printf("M = %d: %.2f planes per row and group\n",M,(double)np/(M*G));
  enum{R=15}; double tb[R],tf[R],tp[R];
  for(int r=0;r<R;r++){ double t0=now(); hb(W,S,1,0,4,V,K,32,XB,M,OB+0,V,2); tb[r]=now()-t0;
    t0=now(); hf(W,S,1,0,4,V,K,32,XF,M,OF,1,V,2); tf[r]=now()-t0; tp[r]=run_proto(); }
  /* check proto (OB now) vs head_f32 (OF) */
  double md=0; for(size_t i=0;i<(size_t)M*V;i++){ double a=b2f(OB[i]),b=b2f(OF[i]); double d=fabs(a-b)/(fabs(b)+1e-3); if(d>md) md=d; }
  qsort(tb,R,8,cmp); qsort(tf,R,8,cmp); qsort(tp,R,8,cmp);
  printf("ms median: native_bf16 %.2f, native_avx512f %.2f, planes+vpdpwssd %.2f (max rel diff vs f32 %.3g)\n",tb[R/2]*1e3,tf[R/2]*1e3,tp[R/2]*1e3,md);
}
