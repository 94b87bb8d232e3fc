/* The probe of docs/performance.md, "ggml-cpu's tables, hidden": a cold document's prefill in the
 * servers' chunks (n_batch 2048; a sliding-window model's checkpoints 4 + n_ubatch and 4 tokens
 * before the end), with the servers' context (-c 8192 -np 4 -t 2), in a C process; prints the
 * decodes' wall time. Built against the vendored llama.cpp's headers and whichever libraries were
 * measured, e.g. the wheel's:
 *   cc -O2 -o prefill prefill.c -I$LLAMA/include -I$LLAMA/ggml/include -L$LIB -lllama -lggml \
 *      -lggml-base -Wl,-rpath,$LIB
 * or llama.cpp's static libraries (libllama.a libggml.a libggml-cpu.a libggml-rpc.a
 * libggml-base.a -fopenmp, linked with c++). Usage: prefill MODEL.gguf DOCUMENT.txt
 */
#include "llama.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
static double now_ms(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec*1e3+t.tv_nsec/1e6;}
static void quiet(enum ggml_log_level l, const char*t, void*u){(void)l;(void)t;(void)u;}
int main(int argc,char**argv){
  const char*model_path=argv[1]; const char*doc_path=argv[2];
  llama_log_set(quiet,NULL);
  llama_backend_init();
  struct llama_model_params mp=llama_model_default_params(); mp.n_gpu_layers=0;
  struct llama_model*m=llama_model_load_from_file(model_path,mp);
  struct llama_context_params cp=llama_context_default_params();
  cp.n_ctx=8192;cp.n_batch=2048;cp.n_ubatch=512;cp.n_seq_max=4;cp.n_threads=2;cp.n_threads_batch=2;cp.kv_unified=false;
  cp.n_outputs_max=4;cp.n_outputs_max_per_seq=1;cp.no_perf=true;
  struct llama_context*c=llama_init_from_model(m,cp);
  FILE*f=fopen(doc_path,"rb");fseek(f,0,SEEK_END);long n=ftell(f);fseek(f,0,SEEK_SET);char*txt=malloc(n+1);fread(txt,1,n,f);txt[n]=0;fclose(f);
  const struct llama_vocab*v=llama_model_get_vocab(m);
  llama_token*toks=malloc(sizeof(llama_token)*8192);
  int nt=llama_tokenize(v,txt,(int)n,toks,8192,true,false);
  int swa=llama_model_n_swa(m)>0;
  int ends[8],ne=0;
  // chunk ends as the servers (n_batch 2048; checkpoints 4+512 and 4 before the end)
  int cands[4]={nt-4-512,nt-4,nt,0};int k;
  for(k=2048;k<nt;k+=2048)ends[ne++]=k;
  for(k=0;k<3;k++){int e=cands[k]; if(k<2&&!swa)continue; if(e<=0)continue; int dup=0; for(int j=0;j<ne;j++)if(ends[j]==e)dup=1; if(!dup)ends[ne++]=e;}
  for(int i=0;i<ne;i++)for(int j=i+1;j<ne;j++)if(ends[j]<ends[i]){int t=ends[i];ends[i]=ends[j];ends[j]=t;}
  double t0=now_ms();int at=0;
  for(int i=0;i<ne;i++){int e=ends[i];struct llama_batch b=llama_batch_init(e-at,0,1);
    for(int j=at;j<e;j++){b.token[b.n_tokens]=toks[j];b.pos[b.n_tokens]=j;b.n_seq_id[b.n_tokens]=1;b.seq_id[b.n_tokens][0]=0;b.logits[b.n_tokens]=(j==e-1&&e==nt);b.n_tokens++;}
    if(llama_decode(c,b)){fprintf(stderr,"decode failed\n");return 1;} llama_batch_free(b);at=e;}
  double ms=now_ms()-t0;
  printf("{\"prompt_ms\": %.2f, \"prompt_n\": %d}\n",ms,nt);
  llama_free(c);llama_model_free(m);return 0;}
